"""The key loop of ``paged_attention.py``'s kernel: online softmax over paged key tiles.

``attend_tiles`` runs ``attend_tile`` over a range of ``TILE_N``-key tiles; each tile's keys
are gathered through the sequence's block-table row (``tile_block_ids``: key ``t`` lives in
block ``block_table_row[t // BLOCK_SIZE]`` at slot ``t % BLOCK_SIZE``). The running state
is the flash-attention triple, in the log2 domain::

    acc [BLOCK_M, HEAD_DIM_PAD]   Σ_keys exp2(s - m) · v     (unnormalised)
    m   [BLOCK_M]                 the running max of the scores s
    l   [BLOCK_M]                 Σ_keys exp2(s - m)

``paged_attention_ref`` (in ``paged_attention.py``) is the torch reference of the whole.
"""

from __future__ import annotations

from vtllm.worker.kernels._triton import tl, triton


@triton.jit
def tile_block_ids(
    block_table_row,
    tile_start,
    kv_end,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The cache block of each key of the tile at ``tile_start``: ``[TILE_N]`` int64 (0
    for keys at or past ``kv_end`` when ``MASKED``)."""
    offs_n = tile_start + tl.arange(0, TILE_N)  # [TILE_N] key positions
    if MASKED:
        block_id = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0)
    else:
        block_id = tl.load(block_table_row + offs_n // BLOCK_SIZE)
    return block_id.to(tl.int64)


@triton.jit
def attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32, unnormalised output so far
    m_i,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i,  # [BLOCK_M] fp32 running sum of exp2(s - m_i)
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos,  # [BLOCK_M] absolute positions
    row_valid,  # [BLOCK_M]
    tile_start,
    kv_end,
    qk_scale,
    block_id,  # [TILE_N] int64, the tile's keys' cache blocks (tile_block_ids)
    k_cache_ptr,
    v_cache_ptr,
    kv_head_id,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    EARLY_V: tl.constexpr,  # request the values with the keys, not after the softmax
):
    """One key tile of online softmax: returns the updated (acc, m_i, l_i). With EARLY_V
    the tile's keys and values are both requested before the first is used, so that
    their memory latencies overlap (a short decode is a chain of such round trips)."""
    offs_n = tile_start + tl.arange(0, TILE_N)  # [TILE_N] key positions
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    slot_in_block = offs_n % BLOCK_SIZE
    if MASKED:
        n_valid = offs_n < kv_end
        k_mask = d_mask[:, None] & n_valid[None, :]
        v_mask = n_valid[:, None] & d_mask[None, :]
    else:
        k_mask = d_mask[:, None]
        v_mask = d_mask[None, :]
    k = tl.load(
        k_cache_ptr
        + block_id[None, :] * stride_k_block
        + slot_in_block[None, :] * stride_k_slot
        + kv_head_id * stride_k_head
        + offs_d[:, None],
        mask=k_mask,
        other=0.0,
    )  # [HEAD_DIM_PAD, TILE_N]
    v_ptrs = (
        v_cache_ptr
        + block_id[:, None] * stride_v_block
        + slot_in_block[:, None] * stride_v_slot
        + kv_head_id * stride_v_head
        + offs_d[None, :]
    )  # [TILE_N, HEAD_DIM_PAD]
    if EARLY_V:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    s = tl.dot(q, k.to(q.dtype), input_precision="ieee") * qk_scale  # [BLOCK_M, TILE_N]
    if MASKED:
        visible = row_valid[:, None] & n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    # rows that have seen no key yet keep -inf; subtract 0 there to avoid inf - inf
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
    alpha = tl.math.exp2(m_i - m_safe)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)
    if not EARLY_V:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def attend_tiles(
    acc, m_i, l_i, q, q_pos, row_valid,
    first_tile,  # key position of the first tile
    tiles_end,  # tiles start below this position
    kv_end, qk_scale, block_table_row, k_cache_ptr, v_cache_ptr, kv_head_id,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, MASKED: tl.constexpr,
    PREFETCH: tl.constexpr,  # tile i + 1's block ids before tile i's keys; V with K
):  # fmt: skip
    """``attend_tile`` over the tiles at ``first_tile, first_tile + TILE_N, ...`` below
    ``tiles_end``: returns the updated (acc, m_i, l_i). With PREFETCH the next tile's
    block ids are requested while this tile's keys and values (requested together) are
    in flight: a short decode then waits on memory about once a tile, not three times
    (ids, keys, values)."""
    if PREFETCH:  # else each tile loads its own ids, as the loop-local block_id
        block_id = tile_block_ids(block_table_row, first_tile, kv_end, TILE_N, BLOCK_SIZE, True)
    for tile_start in range(first_tile, tiles_end, TILE_N):
        if PREFETCH:
            next_block_id = tile_block_ids(
                block_table_row, tile_start + TILE_N, kv_end, TILE_N, BLOCK_SIZE, True
            )
        else:
            block_id = tile_block_ids(
                block_table_row, tile_start, kv_end, TILE_N, BLOCK_SIZE, MASKED
            )
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, row_valid, tile_start, kv_end, qk_scale,
            block_id, k_cache_ptr, v_cache_ptr, kv_head_id,
            stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head,
            HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, SLIDING_WINDOW, MASKED, PREFETCH,
        )  # fmt: skip
        if PREFETCH:
            block_id = next_block_id
    return acc, m_i, l_i
