"""Long first prefill chunks through flash attention (``worker/first_chunk_attention.py``):
which requests go, and the step's attention output against the paged kernel's reference
on every row. On CPU the "kernel" is its torch twin and SDPA runs its math backend, so
this checks the split and the gather from the pages, not the speed; the GPU test runs
the Triton kernel beside CUDA's flash attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtllm.worker import attention
from vtllm.worker.first_chunk_attention import trailing_first_chunks

from .marks import assert_close, gpu
from .paged_batch import make_paged_batch


def _run(q_lens, seq_lens, min_tokens):
    q_lens, seq_lens = np.asarray(q_lens), np.asarray(seq_lens)
    loc = np.concatenate([[0], np.cumsum(q_lens)])
    return trailing_first_chunks(q_lens, seq_lens, loc, min_tokens)


def test_only_a_trailing_run_of_long_first_chunks_is_taken():
    # decode, decode, long first chunk, long first chunk
    assert _run([1, 1, 6, 5], [9, 3, 6, 5], 4) == (2, ((2, 2, 8), (3, 8, 13)))
    # a short first chunk ends the run; so does one with a cached prefix
    assert _run([6, 2, 5], [6, 2, 5], 4) == (2, ((2, 8, 13),))
    assert _run([6, 5], [6, 9], 4) == (2, ())
    # a step that is one long first chunk: no kernel part at all
    assert _run([8], [8], 4) == (0, ((0, 0, 8),))
    assert _run([8], [8], None) == (1, ())


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_step_with_first_chunks_matches_the_paged_reference(num_heads, num_kv_heads, generator):
    device = torch.device("cpu")
    # a decode, a chunk after a cached prefix, then two first chunks (both >= 16 tokens)
    q_lens, context_lens = [1, 7, 40, 23], [30, 12, 0, 0]
    batch = make_paged_batch(
        q_lens, context_lens, num_heads, num_kv_heads, 32, 8, torch.float32, device, generator
    )
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    tables = [
        row[: -(-s // 8)] for row, s in zip(batch.block_tables.tolist(), seq_lens, strict=True)
    ]

    def attend(min_tokens):
        metadata = attention.build_attention_metadata(
            q_lens, seq_lens, tables, 8, device, "triton", first_chunk_min_tokens=min_tokens
        )
        out = attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, metadata, 0.2)
        return out, metadata.kernel_inputs

    expected, plain = attend(None)
    actual, split = attend(16)
    assert plain.first_chunks == () and split.first_chunks_from == 2
    assert [s[0] for s in split.first_chunks] == [2, 3]
    assert_close(actual, expected, "first chunks by SDPA")


@gpu
def test_gpu_first_chunk_flash_attention_matches_the_kernel(device, generator):
    q_lens, context_lens = [1, 1, 64, 1500], [700, 20, 300, 0]
    batch = make_paged_batch(
        q_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, device, generator
    )
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    tables = [
        row[: -(-s // 16)] for row, s in zip(batch.block_tables.tolist(), seq_lens, strict=True)
    ]
    results = []
    for min_tokens in (None, 1024):
        metadata = attention.build_attention_metadata(
            q_lens, seq_lens, tables, 16, device, "triton", first_chunk_min_tokens=min_tokens
        )
        results.append(
            attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, metadata, 128**-0.5)
        )
    assert_close(results[1], results[0], "flash attention vs the paged kernel")
