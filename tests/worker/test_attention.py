"""Paged attention (torch reference) against dense causal attention per request."""

from __future__ import annotations

import math

import pytest
import torch

from vtllm.worker.attention import build_attention_metadata, paged_attention_ref, write_kv_cache

NUM_BLOCKS = 100


def dense_causal(q, k, v, num_context: int, window: int | None = None) -> torch.Tensor:
    """q ``[q_len, H, D]`` at positions num_context.., k/v ``[seq_len, KVH, D]``; with a
    window, query position p sees keys p - window + 1 .. p."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(q.shape[0])[:, None] + num_context
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = (k_pos > q_pos) | (k_pos <= q_pos - window if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_mixed_batch_matches_dense(block_size, num_heads, num_kv_heads, window):
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads)
    head_dim = 8
    # (context already cached, tokens computed now): fresh prefill, prefill continuing a
    # cached prefix, decodes with short and long histories, a one-token prompt
    requests = [(0, 7), (9, 5), (12, 1), (1, 1), (0, 1), (30, 1), (5, 13)]
    k_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, full_k, full_v, qs, new_k, new_v = [], [], [], [], [], []
    for num_context, num_new in requests:
        seq_len = num_context + num_new
        table = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        if num_context:  # the prefix was written by earlier steps
            prefix = build_attention_metadata(
                [num_context], [num_context], [table], block_size, torch.device("cpu")
            )
            write_kv_cache(k[:num_context], v[:num_context], k_cache, v_cache, prefix.slot_mapping)
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[num_context:])
        new_v.append(v[num_context:])
        qs.append(torch.randn(num_new, num_heads, head_dim, generator=gen))
    metadata = build_attention_metadata(
        [n for _, n in requests],
        [c + n for c, n in requests],
        tables,
        block_size,
        torch.device("cpu"),
    )
    write_kv_cache(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, metadata.slot_mapping)
    out = paged_attention_ref(torch.cat(qs), k_cache, v_cache, metadata, head_dim**-0.5, window)
    expected = torch.cat(
        [
            dense_causal(q, k, v, c, window)
            for q, k, v, (c, _) in zip(qs, full_k, full_v, requests, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert len(metadata.groups) == 2  # decodes and prefills attended as two padded batches


def test_slot_mapping_follows_block_table():
    metadata = build_attention_metadata(
        [3, 1], [10, 2], [[7, 2, 9], [5]], block_size=4, device=torch.device("cpu")
    )
    # request 0 computes tokens 7, 8, 9: block 2 offset 3, block 9 offsets 0 and 1
    assert metadata.slot_mapping.tolist() == [2 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 5 * 4 + 1]


def test_short_block_table_is_refused():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_attention_metadata([9], [9], [[0, 1]], block_size=4, device=torch.device("cpu"))
