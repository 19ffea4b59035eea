"""Random paged-KV batches for the attention and cache kernel tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """One step: sequence ``s`` adds ``q_lens[s]`` tokens after ``context_lens[s]`` cached."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks]
    slot_mapping: torch.Tensor  # [num_tokens]
    q_lens: list[int]
    seq_lens_list: list[int]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)


def make_paged_batch(
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    index_dtype: torch.dtype = torch.int32,
    num_spare_blocks: int = 3,
) -> PagedBatch:
    """A batch whose blocks are scattered over the cache in random order.

    Every slot that belongs to no sequence (spare blocks, the tail of each last block) is
    NaN, and block-table padding points past the cache, so a kernel that reads one key
    too many fails loudly instead of blending in noise.
    """
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + num_spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    max_num_blocks = max(blocks_needed) + 2
    block_tables = torch.full((len(seq_lens), max_num_blocks), num_blocks + 1000)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    slots = []
    used = 0
    for seq_id, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        table = order[used : used + blocks_needed[seq_id]]
        used += blocks_needed[seq_id]
        block_tables[seq_id, : len(table)] = table
        positions = torch.arange(seq_len)
        seq_slots = table[positions // block_size] * block_size + positions % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=generator
        )
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=generator
        )
        slots.append(seq_slots[seq_len - q_len :])
    num_tokens = sum(q_lens)
    cumulative = torch.tensor([0, *q_lens]).cumsum(0)
    return PagedBatch(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(device, dtype),
        k_new=torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(
            device, dtype
        ),
        v_new=torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(
            device, dtype
        ),
        k_cache=k_cache.to(device, dtype),
        v_cache=v_cache.to(device, dtype),
        query_start_loc=cumulative.to(device, index_dtype),
        seq_lens=torch.tensor(seq_lens).to(device, index_dtype),
        block_tables=block_tables.to(device, index_dtype),
        slot_mapping=torch.cat(slots).to(device, torch.int64),
        q_lens=list(q_lens),
        seq_lens_list=seq_lens,
    )
