"""Unified paged attention: prefill chunks and decodes of one step in a single launch.

KV cache of one layer: ``k_cache`` and ``v_cache``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; key ``t`` of sequence ``s`` lives in
block ``block_tables[s, t // block_size]`` at offset ``t % block_size``.

Sequence ``s`` owns query tokens ``query_start_loc[s] .. query_start_loc[s + 1] - 1``,
which are its last ``q_len`` tokens: query ``i`` sits at absolute position
``seq_lens[s] - q_len + i`` and sees keys ``0 .. position`` (and, with a sliding window
``w``, only keys ``> position - w``). A decode is just a sequence with ``q_len == 1``.

Work split. One program owns ``BLOCK_Q`` consecutive query tokens of one sequence and
one KV head; its ``BLOCK_M = BLOCK_Q * group_size`` rows are the (token, query head)
pairs that share that KV head, so K/V tiles are loaded once per group (GQA)::

    row r  ->  token  q_block * BLOCK_Q + r // group_size
               head   kv_head * group_size + r % group_size

A decode-only step (as many query tokens as sequences, so one each) skips that numbering:
program ``i`` is sequence ``i``, with no search and no spare programs.

Otherwise query blocks are numbered without a host sync: sequence ``s`` starts at query block
``query_start_loc[s] // BLOCK_Q + s``, which is strictly increasing and leaves room for
``cdiv(q_len, BLOCK_Q)`` blocks, so ``num_tokens // BLOCK_Q + num_seqs`` programs cover
every batch; each program finds its sequence by binary search and surplus ones exit::

    query_start_loc [0, 5, 6, 7], BLOCK_Q 4
    seq:          0       0      (0)   1     2      (spare)
    query block:  0       1       2    3     4       5
    tokens:      0..3     4      --    5     6       --

Split-KV (flash-decoding): with ``num_kv_splits > 1`` each (query block, KV head) gets
that many programs, each over a contiguous share of the key tiles; they write
unnormalised partial outputs with their running max and sum, and
``kv_splits.py`` merges them (its docstring has the math). It pays off when a few long
decodes would otherwise leave most of the GPU idle.

The key loop lives in ``attention_loop.py``; the fused prep in ``decode_prep.py``.

Fused prep (``prep=DecodePrep(...)``, decode-only steps with the shorter chain of loads):
``q`` is then the qkv projection, and each program does ``kernels/qkv_prep.py``'s work for
its token and KV head — q/k norm, rotary, the input norm's ``1/rms`` in the MoE decode
chain — before attending. The program whose share of keys ends at the token's own stores
that k/v in the cache and attends to it from registers (one more step of online softmax,
the key read back as the cache would give it: rounded, or e4m3-quantised), its loop
stopping one key short: no program reads a slot this launch writes. One launch a layer
fewer at batch 1; other steps run ``qkv_prep`` first.

FP8 caches (``worker/kv_cache_dtype.py``) hold ``K / k_scale`` and ``V / v_scale`` in
e4m3. Dequantising is linear, so the kernel never multiplies a tile: it converts fp8 to
the dots' dtype (exact: fp16 under bf16 queries, ``FP8_FP16_OPERANDS``; else the
query's) and folds the scales into two scalars::

    softmax(q · (k8 · k_scale) · scale) = softmax(q · k8 · (scale · k_scale))
    Σ p · (v8 · v_scale)                = (Σ p · v8) · v_scale
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vtllm.worker.kernels._triton import max_shared_memory, tl, triton
from vtllm.worker.kernels.attention_loop import attend_tiles
from vtllm.worker.kernels.decode_prep import (
    DecodePrep,
    attend_new_key,
    prep_decode,
    prep_kernel_args,
)
from vtllm.worker.kernels.kv_splits import (
    choose_num_kv_splits,
    reduce_splits,
    split_partials,
)
from vtllm.worker.kv_cache_dtype import dequantize_fp8_ref, is_fp8

# Decode-only batches with fewer dependent loads a program (no query_start_loc loads, K
# and V requested together, the next tile's block ids loaded while a tile's keys are in
# flight: ~4 round trips to memory at 160 keys instead of ~8). H100, 2026-12-07
# (`attention_kernel.py --splits --decode-prefetch both`, docs/BENCHMARKS.md): one
# sequence of 160 keys 7.15-7.74 -> 6.60-6.81 us on three model shapes, of 1,024 keys (8
# splits) 7.37-7.47 -> 6.90-7.02 us; 256 x 1,024 and 64 x 4,096 keys within 0.5 %.
# End to end, batch 1: Qwen3-0.6B 887.4 -> 919.6 tok/s, Qwen3-30B-A3B 284.0 -> 288.7.
DECODE_PREFETCH = True

# Over an FP8 cache and bf16 queries, the dots take fp16 operands (q converted once,
# clamped to fp16's range; keys, values and probabilities converted a tile at a time)
# instead of q's bf16: e4m3 widens to fp16 in one instruction per pair, to bf16 only
# through fp32. Exact for the cache (e4m3 fits fp16) and for q (bf16 in fp16's normal
# range; fp16 has 3 more mantissa bits), so results match the bf16-operand kernel's or
# are closer to fp32. H100, session 39 (docs/BENCHMARKS.md): 256 x 1k keys of the
# Llama-3-8B shape 0.3304 -> 0.2875 ms (2 stages), Qwen3-0.6B's 0.4052 -> 0.2938 ms.
FP8_FP16_OPERANDS = True


@triton.jit(do_not_specialize=["num_seqs"])  # step-sized: compile once
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when NUM_KV_SPLITS == 1
    partial_out_ptr,  # [num_tokens, num_heads, NUM_KV_SPLITS, HEAD_DIM_PAD] fp32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_KV_SPLITS] fp32, log2 domain
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_KV_SPLITS] fp32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    block_tables_ptr,  # [num_seqs, max_num_blocks]
    k_scale_ptr,  # [] fp32, read when KV_FP8
    v_scale_ptr,  # [] fp32, read when KV_FP8
    num_seqs,
    scale_log2,  # softmax scale * log2(e): scores live in the log2 domain
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold e4m3 values of K / k_scale, V / v_scale
    FP16_OPERANDS: tl.constexpr,  # with KV_FP8: the dots in fp16 (FP8_FP16_OPERANDS)
    ONE_QUERY_A_SEQ: tl.constexpr,  # every sequence has one query token: block i is seq i
    DECODE_PREFETCH: tl.constexpr,  # with ONE_QUERY_A_SEQ only: fewer dependent loads
    # PREP (with DECODE_PREFETCH only): q_ptr is the qkv projection (q heads, k heads, v
    # heads a token row; stride_q_head = HEAD_DIM) and the kernel does qkv_prep's work
    # (module docstring, "Fused prep"); the rest of these are read only then
    positions_ptr,  # [num_seqs]
    cos_sin_cache_ptr,  # [max_position, 2 * HALF] fp32
    slot_mapping_ptr,  # [num_seqs]; -1 = padding
    q_norm_ptr,  # [HEAD_DIM]; read when NORM
    k_norm_ptr,
    stream_ptr,  # [num_seqs, hidden]; read when INPUT_RSTD
    stride_cache_pos,
    stride_stream_token,
    norm_eps,
    hidden,
    input_eps,
    PREP: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    INPUT_RSTD: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head_id = tl.program_id(1)
    split_id = tl.program_id(2)

    if ONE_QUERY_A_SEQ:
        seq_id = q_block_id
    else:  # the last sequence whose first query block is <= q_block_id
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if first_block <= q_block_id:
                lo = mid + 1
            else:
                hi = mid
        seq_id = lo - 1

    if DECODE_PREFETCH:
        # row i is sequence i's one token (query_start_loc is 0, 1, ..., num_seqs): no
        # loads of it, so that the first round trip to memory fetches seq_len and q
        q_start = seq_id
        q_len = 1
        q_block_local = 0
    else:
        q_start = tl.load(query_start_loc_ptr + seq_id)
        q_len = tl.load(query_start_loc_ptr + seq_id + 1) - q_start
        if ONE_QUERY_A_SEQ:
            q_block_local = 0
        else:
            q_block_local = q_block_id - (q_start // BLOCK_Q + seq_id)
        if q_block_local * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq_id)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_local = q_block_local * BLOCK_Q + offs_m // GROUP_SIZE  # [BLOCK_M]
    head_id = kv_head_id * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * GROUP_SIZE) & (q_local < q_len)  # [BLOCK_M]
    q_pos = context_len + q_local  # [BLOCK_M] absolute positions
    token_id = q_start + q_local  # [BLOCK_M]

    q_rows = q_ptr + token_id[:, None] * stride_q_token + head_id[:, None] * stride_q_head
    q = tl.load(
        q_rows + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if PREP:  # q/k/v of this token from the projection; k and v kept for the last key
        q, k_new, v_new = prep_decode(
            q, q_rows, row_valid, seq_id, kv_head_id, q_ptr, stride_q_token,
            tl.num_programs(1) * GROUP_SIZE, tl.num_programs(1), positions_ptr,
            cos_sin_cache_ptr, q_norm_ptr, k_norm_ptr, stream_ptr, stride_cache_pos,
            stride_stream_token, norm_eps, hidden, input_eps,
            HEAD_DIM, HEAD_DIM_PAD, HALF, NORM, WEIGHT_OFFSET, INPUT_RSTD, HIDDEN_PAD,
        )  # fmt: skip

    if FP16_OPERANDS:  # k_new/v_new keep q's dtype: attend_new_key rounds them to e4m3
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    # keys this query block can see: [kv_start, kv_end)
    last_local = tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_local + 1
    kv_start = 0
    if SLIDING_WINDOW > 0:
        first_pos = context_len + q_block_local * BLOCK_Q
        kv_start = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // TILE_N * TILE_N
    if NUM_KV_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), NUM_KV_SPLITS)
        kv_start = kv_start + split_id * tiles_per_split * TILE_N
        kv_end = tl.minimum(kv_start + tiles_per_split * TILE_N, kv_end)
    # PREP: the program whose keys end at the token's own writes its k/v to the cache and
    # attends to it from registers (the cache holds it only once this kernel ends)
    if PREP:
        holds_new_key = (kv_start < kv_end) & (kv_end == seq_len)
        kv_end = tl.where(holds_new_key, kv_end - 1, kv_end)

    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq_id.to(tl.int64) * stride_bt_seq
    # Key tiles that end at or before the block's first query position are visible to
    # every row: no mask there, only on the tiles after (the diagonal, the ragged end).
    # DECODE_PREFETCH: one query a sequence sees every key before kv_end (in its window),
    # so one masked loop that prefetches (``attend_tiles``).
    full_end = kv_start
    if SLIDING_WINDOW == 0 and not DECODE_PREFETCH:
        first_q_pos = context_len + q_block_local * BLOCK_Q
        visible_to_all = tl.minimum(first_q_pos + 1, kv_end) - kv_start
        full_end = kv_start + tl.maximum(visible_to_all, 0) // TILE_N * TILE_N
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, row_valid, kv_start, full_end, kv_end, qk_scale,
        block_table_row, k_cache_ptr, v_cache_ptr, kv_head_id,
        stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
        HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, SLIDING_WINDOW, False, False,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, row_valid, full_end, kv_end, kv_end, qk_scale,
        block_table_row, k_cache_ptr, v_cache_ptr, kv_head_id,
        stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
        HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, SLIDING_WINDOW, True, DECODE_PREFETCH,
    )  # fmt: skip
    if PREP:
        acc, m_i, l_i = attend_new_key(
            acc, m_i, l_i, q, k_new, v_new, row_valid, holds_new_key, qk_scale, seq_id,
            kv_head_id, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot,
            stride_v_head, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, KV_FP8, FP8_MAX,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)

    if NUM_KV_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + token_id[:, None] * stride_o_token
            + head_id[:, None] * stride_o_head
            + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        num_heads = tl.num_programs(1) * GROUP_SIZE
        partial_id = (token_id.to(tl.int64) * num_heads + head_id) * NUM_KV_SPLITS + split_id
        tl.store(
            partial_out_ptr + partial_id[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(partial_max_ptr + partial_id, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial_id, l_i, mask=row_valid)


@dataclass(frozen=True)
class AttentionTiles:
    """One launch configuration: ``block_m`` (token, head) rows a program (a power of two,
    at least the GQA group), ``tile_n`` keys an iteration, warps and pipeline stages."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


def choose_tiles(
    decode_only: bool,
    group_size: int,
    head_dim_pad: int,
    element_size: int = 2,
    shared_memory: int = 1 << 40,
    cache_element_size: int | None = None,
) -> AttentionTiles:
    """The launcher's default tiles for queries of ``element_size`` bytes over a cache of
    ``cache_element_size`` (default: the queries') on a device with ``shared_memory``
    bytes a program. Decode-only batches need few query rows per program and wide key
    tiles; steps with prefill rows take 64-row query tiles.

    Decode, 16-bit queries, head_dim <= 128, at least 192 KiB (Hopper-class), from an
    H200 sweep (``benchmarks/attention_kernel.py --sweep``, Llama-3-8B heads): 16x128
    (3.40 / 3.63 TB/s at 256 x 1k / 64 x 4k keys, against 3.25 / 2.52 for 16x64).
    Over a one-byte (FP8) cache, 3 stages: a tile holds half the bytes, so one more in
    flight (H100 sweep, ``--sweep --no-prefill --kv-cache-dtypes fp8``, fp16 dots, 72
    configurations: 16x128 w4 s3 the best at 256 x 1k and 64 x 4k keys on the Llama-3-8B
    shape and 256 x 1k on Qwen3-0.6B's, 1.90 / 2.06 / 1.90 TB/s against 1.87 / 1.91 /
    1.83 with 2 stages).
    Elsewhere, and for every step with prefill rows: the first sweep's tiles, decode 16x64,
    prefill 64x32, 4 warps (8 for wider heads), 2 stages. The sweep's best 8k-token
    prefill tile (128x64, 8 warps, 3 stages: 1.64 against 2.19 ms a layer) is not the
    default: in mixed steps every decode row pays a 128-row program, and at 8 KV heads a
    512-token chunk fills only 128 programs (H200, Qwen3-0.6B shape, 256 prompts: 10,596
    output tok/s with it against 18,488 without); long first chunks go to flash attention
    (``first_chunk_attention``) instead."""
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group_size))
    if decode_only and element_size == 2 and head_dim_pad <= 128 and shared_memory >= 192 * 1024:
        return AttentionTiles(block_m, 128, 4, 3 if cache_element_size == 1 else 2)
    tile_n = 64 if decode_only and head_dim_pad <= 128 else 32
    return AttentionTiles(block_m, tile_n, 4 if head_dim_pad <= 128 else 8, 2)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, tokens incl. this step's
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32/int64
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
    v_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
    tiles: AttentionTiles | None = None,
    search_sequences: bool = False,
    decode_prefetch: bool | None = None,
    prep: DecodePrep | None = None,
    fp8_fp16_operands: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged keys and values.

    The step's K/V must already be in the cache (``reshape_and_cache``). Sequence ``s``
    owns query rows ``query_start_loc[s] .. query_start_loc[s + 1] - 1``, its last
    ``q_len`` tokens; query ``i`` sits at position ``p = seq_lens[s] - q_len + i`` and
    attends to keys ``0 .. p`` (``p - sliding_window + 1 .. p`` with a window). Query
    head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Rows past
    ``query_start_loc[-1]`` are left untouched. Softmax runs in fp32.

    ``max_seq_len`` (a host-side hint, e.g. from the CPU copy of ``seq_lens``) lets the
    launcher pick the split-KV path for long decodes; ``num_kv_splits`` forces it
    (a power of two > 1) or forces the single pass (1). An FP8 cache needs ``k_scale``
    and ``v_scale`` (device scalars: keys are ``float(k_cache) * k_scale``); other caches
    ignore them. ``tiles`` overrides the launch configuration (``choose_tiles``; for
    sweeps). A batch of as many tokens as sequences (every sequence one token: sequences
    never have zero) gives each sequence one program directly; ``search_sequences`` makes
    it number query blocks as mixed steps do (for benchmarks and tests);
    ``decode_prefetch`` (default ``DECODE_PREFETCH``) gives those programs the shorter
    chain of loads (same results); ``fp8_fp16_operands`` (default ``FP8_FP16_OPERANDS``)
    the fp16 dots over an FP8 cache. Returns ``out`` ``[num_tokens, num_heads, head_dim]``
    in q's dtype.

    With ``prep``, ``q`` is the qkv projection ``[num_tokens, (num_heads + 2 *
    num_kv_heads) * head_dim]`` and the step's k/v are not in the cache yet: this call
    stores them and attends as ``qkv_prep`` followed by the call without ``prep`` would
    (one launch on decode-only steps with the shorter chain of loads, two otherwise).
    """
    num_seqs = seq_lens.shape[0]
    if prep is not None:
        num_kv_heads, head_dim = k_cache.shape[2:]
        fused = q.shape[0] == num_seqs and not search_sequences
        if not fused or not (DECODE_PREFETCH if decode_prefetch is None else decode_prefetch):
            q = prep.run_qkv_prep(q, num_kv_heads, head_dim, k_cache, v_cache, k_scale, v_scale)
            prep = None
        else:
            prep.check(q, num_kv_heads, head_dim, k_cache)
            q = q.view(q.shape[0], -1, head_dim)[:, : prep.num_heads]  # qkv's q heads, strided
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    _check_inputs(q, k_cache, v_cache, query_start_loc, block_tables, num_seqs)
    kv_fp8 = _check_scales(k_cache, k_scale, v_scale)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} but the KV cache has {cache_head_dim}")
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_tokens, num_seqs, num_kv_heads, max_seq_len)
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    prep_args = prep_kernel_args(prep, q, k_cache)

    group_size = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tiles = tiles or choose_tiles(
        num_tokens == num_seqs,
        group_size,
        head_dim_pad,
        q.element_size(),
        max_shared_memory(q.device),
        k_cache.element_size(),
    )
    if tiles.block_m < group_size or tiles.block_m & (tiles.block_m - 1):
        raise ValueError(f"block_m {tiles.block_m}: a power of two >= the group {group_size}")
    block_m, tile_n = tiles.block_m, tiles.tile_n
    block_q = block_m // group_size
    one_query_a_seq = num_tokens == num_seqs and not search_sequences
    num_q_blocks = num_seqs if one_query_a_seq else num_tokens // block_q + num_seqs
    if num_kv_splits > 1:
        partials = split_partials(num_tokens, num_heads, num_kv_splits, head_dim_pad, q.device)
    else:
        partials = (out, out, out)  # unused by the kernel
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_kv_splits)](
        out,
        *partials,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        k_scale if kv_fp8 else seq_lens,  # unread without KV_FP8
        v_scale if kv_fp8 else seq_lens,
        num_seqs,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        SLIDING_WINDOW=sliding_window or 0,
        NUM_KV_SPLITS=num_kv_splits,
        KV_FP8=kv_fp8,
        FP16_OPERANDS=kv_fp8
        and q.dtype == torch.bfloat16
        and (FP8_FP16_OPERANDS if fp8_fp16_operands is None else fp8_fp16_operands),
        ONE_QUERY_A_SEQ=one_query_a_seq,
        DECODE_PREFETCH=one_query_a_seq
        and (DECODE_PREFETCH if decode_prefetch is None else decode_prefetch),
        **prep_args,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_kv_splits > 1:
        reduce_splits(out, partials, query_start_loc, num_seqs)
    return out


def _check_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """Whether the cache is FP8; ValueError when it comes without its two scales."""
    if not is_fp8(k_cache.dtype):
        return False
    if k_scale is None or v_scale is None or k_scale.numel() != 1 or v_scale.numel() != 1:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale (one number each)")
    return True


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_tables: torch.Tensor,
    num_seqs: int,
) -> None:
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) axis")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} sequences need query_start_loc [{num_seqs + 1}] and block_tables "
            f"[{num_seqs}, *], got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )
    if not query_start_loc.is_contiguous() or block_tables.stride(-1) != 1:
        raise ValueError("query_start_loc and block_tables rows must be contiguous")


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch ``paged_attention`` (same contract), one sequence at a time in fp32
    (an FP8 cache dequantised: ``float(cache) * scale``).

    ``max_seq_len`` and ``num_kv_splits`` only steer the kernel and are ignored here.
    """
    if _check_scales(k_cache, k_scale, v_scale):
        k_scale, v_scale = k_scale.float(), v_scale.float()
    else:
        k_scale = v_scale = None
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for seq_id, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq_id], starts[seq_id + 1]
        q_len = end - start
        if q_len == 0:
            continue
        key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        blocks = block_tables[seq_id, key_pos // block_size].long()  # [seq_len]
        k = k_cache[blocks, key_pos % block_size].float()  # [seq_len, num_kv_heads, head_dim]
        v = v_cache[blocks, key_pos % block_size].float()
        if k_scale is not None:
            k, v = dequantize_fp8_ref(k, k_scale), dequantize_fp8_ref(v, v_scale)
        k = k.repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group_size, dim=1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
        visible = key_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window:
            visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))  # [num_heads, q_len, seq_len]
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
