"""The fused q/k prep of decode attention (``paged_attention(prep=DecodePrep(...))``).

On decode-only steps with the shorter chain of loads, ``q`` handed to ``paged_attention``
is the qkv projection and each program does ``kernels/qkv_prep.py``'s work for its token
and KV head (q/k norm, rotary, the input norm's ``1/rms`` in the MoE decode chain) before
attending: ``prep_decode``. The program whose share of keys ends at the token's own stores
that k/v in the cache and attends to it from registers: ``attend_new_key``. On other
steps ``DecodePrep.run_qkv_prep`` runs ``qkv_prep`` first. ``qkv_prep_ref`` followed by
``paged_attention_ref`` is the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtllm.worker.kernels._triton import tl, triton
from vtllm.worker.kernels.qkv_prep import (
    NO_NORM,
    check_inputs,
    norm_kind,
    prep_heads,
    qkv_prep,
    rotary_lanes,
    stream_rstd,
)
from vtllm.worker.kv_cache_dtype import is_fp8


@dataclass(frozen=True)
class DecodePrep:
    """``qkv_prep``'s inputs besides qkv and the caches, for ``paged_attention`` given the
    projection instead of q (``prep=``): on decode-only steps the attention kernel does
    that work itself (this module's docstring; ``paged_attention.py``'s, "Fused prep");
    on other steps ``qkv_prep`` runs first. The fields mean what ``qkv_prep``'s arguments
    of the same names mean."""

    num_heads: int
    positions: torch.Tensor  # [num_tokens]
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] fp32
    slot_mapping: torch.Tensor  # [num_tokens], -1 = padding
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    gemma_norm: bool = False
    weight_offset: float = 1.0
    input_stream: torch.Tensor | None = None  # [num_tokens, hidden]
    input_eps: float = 1e-6

    def run_qkv_prep(self, qkv, num_kv_heads, head_dim, k_cache, v_cache, k_scale, v_scale):
        """``qkv_prep`` (its own kernel) with these inputs: q ``[tokens, heads, head_dim]``."""
        return qkv_prep(
            qkv, self.num_heads, num_kv_heads, head_dim, self.positions, self.cos_sin_cache,
            k_cache, v_cache, self.slot_mapping, self.q_norm, self.k_norm, self.eps,
            self.gemma_norm, self.weight_offset, k_scale, v_scale, self.input_stream,
            self.input_eps,
        )  # fmt: skip

    def check(self, qkv, num_kv_heads, head_dim, k_cache) -> None:
        """``qkv_prep``'s checks of these inputs with ``qkv``: ValueError naming what
        disagrees."""
        check_inputs(
            qkv, self.num_heads, num_kv_heads, head_dim, self.positions, self.cos_sin_cache,
            k_cache, self.slot_mapping, self.input_stream,
        )  # fmt: skip


def prep_kernel_args(prep: DecodePrep | None, q: torch.Tensor, k_cache: torch.Tensor) -> dict:
    """The kernel's PREP arguments: ``prep``'s tensors and constexprs (its inputs already
    checked), or placeholders (never read) without it."""
    if prep is None:
        unread = q
        return dict(
            positions_ptr=unread, cos_sin_cache_ptr=unread, slot_mapping_ptr=unread,
            q_norm_ptr=unread, k_norm_ptr=unread, stream_ptr=unread, stride_cache_pos=0,
            stride_stream_token=0, norm_eps=1e-6, hidden=1, input_eps=1e-6, PREP=False,
            HALF=1, NORM=NO_NORM, WEIGHT_OFFSET=1.0, INPUT_RSTD=False, HIDDEN_PAD=1,
            FP8_MAX=0.0,
        )  # fmt: skip
    rotary_dim = prep.cos_sin_cache.shape[1]  # inputs checked (DecodePrep.check)
    stream = prep.input_stream if prep.input_stream is not None else q
    norm = norm_kind(prep.q_norm, prep.gemma_norm)
    return dict(
        positions_ptr=prep.positions, cos_sin_cache_ptr=prep.cos_sin_cache,
        slot_mapping_ptr=prep.slot_mapping,
        q_norm_ptr=prep.q_norm if prep.q_norm is not None else q,
        k_norm_ptr=prep.k_norm if prep.k_norm is not None else q, stream_ptr=stream,
        stride_cache_pos=prep.cos_sin_cache.stride(0), stride_stream_token=stream.stride(0),
        norm_eps=prep.eps, hidden=stream.shape[-1] if prep.input_stream is not None else 1,
        input_eps=prep.input_eps, PREP=True, HALF=rotary_dim // 2, NORM=norm,
        WEIGHT_OFFSET=prep.weight_offset, INPUT_RSTD=prep.input_stream is not None,
        HIDDEN_PAD=triton.next_power_of_2(stream.shape[-1]) if prep.input_stream is not None else 1,
        FP8_MAX=torch.finfo(k_cache.dtype).max if is_fp8(k_cache.dtype) else 0.0,
    )  # fmt: skip


@triton.jit
def prep_decode(
    q,  # [BLOCK_M, HEAD_DIM_PAD]: the group's q heads of the token, from the projection
    q_rows,  # [BLOCK_M, 1] pointers to those heads
    row_valid,
    token,  # the sequence's one token (a decode-only step: token i is sequence i)
    kv_head_id,
    qkv_ptr, stride_qkv_token, num_heads, num_kv_heads, positions_ptr, cos_sin_cache_ptr,
    q_norm_ptr, k_norm_ptr, stream_ptr, stride_cache_pos, stride_stream_token, norm_eps,
    hidden, input_eps,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr,
    NORM: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, INPUT_RSTD: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
):  # fmt: skip
    """``(q, k, v)`` of one decode token as ``qkv_prep`` leaves them: q ``[BLOCK_M,
    HEAD_DIM_PAD]`` and this KV head's k and v ``[HEAD_DIM_PAD]``, normed and rotated
    (``qkv_prep.prep_heads``)."""
    offs = tl.arange(0, HEAD_DIM_PAD)
    mask = offs < HEAD_DIM
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin, rotated = rotary_lanes(cos_sin_cache_ptr + pos * stride_cache_pos, offs, HALF)
    q_partner = tl.load(
        q_rows + partner[None, :], mask=row_valid[:, None] & (mask & rotated)[None, :], other=0.0
    )
    row = qkv_ptr + token.to(tl.int64) * stride_qkv_token
    k_row = row + (num_heads + kv_head_id) * HEAD_DIM
    k = tl.load(k_row + offs, mask=mask, other=0.0)  # [HEAD_DIM_PAD]
    k_partner = tl.load(k_row + partner, mask=mask & rotated, other=0.0)
    v = tl.load(
        row + (num_heads + num_kv_heads + kv_head_id) * HEAD_DIM + offs, mask=mask, other=0.0
    )
    input_rstd = 1.0
    if INPUT_RSTD:
        input_rstd = stream_rstd(
            stream_ptr + token.to(tl.int64) * stride_stream_token, hidden, input_eps, HIDDEN_PAD
        )
        v = (v.to(tl.float32) * input_rstd).to(v.dtype)
    q = prep_heads(
        q, q_partner, input_rstd, q_norm_ptr, norm_eps, cos[None, :], sin[None, :],
        rotated[None, :], offs[None, :], partner[None, :], mask[None, :],
        HEAD_DIM, HALF, NORM, WEIGHT_OFFSET, INPUT_RSTD, 1,
    )  # fmt: skip
    k = prep_heads(
        k, k_partner, input_rstd, k_norm_ptr, norm_eps, cos, sin, rotated, offs, partner, mask,
        HEAD_DIM, HALF, NORM, WEIGHT_OFFSET, INPUT_RSTD, 0,
    )  # fmt: skip
    return q, k, v


@triton.jit
def attend_new_key(
    acc, m_i, l_i, q, k, v,  # k, v [HEAD_DIM_PAD]: the token's own, from prep_decode
    row_valid,  # [BLOCK_M]
    holds,  # whether this program's keys end at the token's own (else it does nothing)
    qk_scale, token, kv_head_id, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
    v_scale_ptr, stride_k_block, stride_k_slot, stride_k_head, stride_v_block,
    stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """The token's k/v stored at its slot (as ``qkv_prep`` stores them; not for slot -1)
    by the program that holds it, and one more key of online softmax from registers, read
    as the cache would give it back (rounded to the cache dtype, e4m3 quantised)."""
    offs = tl.arange(0, HEAD_DIM_PAD)
    mask = offs < HEAD_DIM
    if KV_FP8:
        k = tl.clamp(tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if holds & (slot >= 0):
        block_id = slot // BLOCK_SIZE
        k_dst = block_id * stride_k_block + (slot % BLOCK_SIZE) * stride_k_slot
        v_dst = block_id * stride_v_block + (slot % BLOCK_SIZE) * stride_v_slot
        tl.store(k_cache_ptr + k_dst + kv_head_id * stride_k_head + offs, k, mask=mask)
        tl.store(v_cache_ptr + v_dst + kv_head_id * stride_v_head + offs, v, mask=mask)
    k = k.to(q.dtype).to(tl.float32)
    s = tl.sum(q.to(tl.float32) * k[None, :], 1) * qk_scale  # [BLOCK_M]
    s = tl.where(row_valid & holds, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe)  # [BLOCK_M]
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + p
    v = v.to(q.dtype).to(tl.float32)
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v[None, :]
    return acc, m_new, l_i
