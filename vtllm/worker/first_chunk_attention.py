"""Long first prefill chunks through the platform's flash attention.

A request's *first* chunk (no cached prefix) attends only over its own keys: plain causal
attention, which torch's ``scaled_dot_product_attention`` runs with the platform's flash
kernel at ~2.5x the Triton paged kernel's rate on an H200 (an 8,000-token Llama-3-8B
prompt: 0.88 vs 2.19 ms a layer, ``benchmarks/attention_kernel.py``). The keys are read
back from the request's pages into one contiguous tensor (16 MiB a layer at 8k tokens,
microseconds), so the cache stays the only place K and V are written.

Only a *trailing run* of such requests leaves the paged kernel: it takes the sequences
before them as a prefix of its inputs (``query_start_loc[:n + 1]``), and its rows stop
there. Which run a step has is decided on the host when the metadata is built::

    requests  decode decode [chunk, cached prefix] [first chunk 3000] [first chunk 1500]
    kernel    ------------- all three ---------------
    SDPA                                            one call each
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from vtllm.worker.platform import PlatformKind, platform_of

# Shorter first chunks stay in the paged kernel: below this the gather and the extra
# launches cost about what flash attention saves.
FIRST_CHUNK_SDPA_MIN_TOKENS = 1024


def default_min_tokens(device: torch.device) -> int | None:
    """``FIRST_CHUNK_SDPA_MIN_TOKENS`` on CUDA; None (never) elsewhere: ROCm's SDPA may
    serve grouped-query attention by its math fallback, and CPU steps use the torch
    backend's own grouping."""
    if platform_of(device).kind is PlatformKind.CUDA:
        return FIRST_CHUNK_SDPA_MIN_TOKENS
    return None


def trailing_first_chunks(
    query_lens: np.ndarray,  # [num_reqs] int
    seq_lens: np.ndarray,  # [num_reqs] int
    query_start_loc: np.ndarray,  # [num_reqs + 1] int
    min_tokens: int | None,
) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """(the first request of the step's trailing run of first chunks of at least
    ``min_tokens`` tokens, and per request of that run ``(request, first token, end
    token)``). No such run, or ``min_tokens`` None: ``(num_reqs, ())``."""
    num_reqs = len(query_lens)
    start = num_reqs
    if min_tokens is not None:
        while (
            start > 0
            and seq_lens[start - 1] == query_lens[start - 1]
            and query_lens[start - 1] >= min_tokens
        ):
            start -= 1
    segments = tuple(
        (r, int(query_start_loc[r]), int(query_start_loc[r + 1])) for r in range(start, num_reqs)
    )
    return start, segments


def attend_first_chunks(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] on q's device
    segments: tuple[tuple[int, int, int], ...],
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written on each segment's rows
) -> None:
    """Causal attention of each ``(request, first, end)`` segment over its own keys,
    which the cache already holds at positions ``0 .. end - first - 1``."""
    block_size = k_cache.shape[1]
    for request, first, end in segments:
        length = end - first
        table = block_tables[request, : -(-length // block_size)]  # [blocks], on the device
        k = k_cache[table].flatten(0, 1)[:length]  # [length, num_kv_heads, head_dim]
        v = v_cache[table].flatten(0, 1)[:length]
        attended = F.scaled_dot_product_attention(
            q[first:end].transpose(0, 1)[None],  # [1, num_heads, length, head_dim]
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )  # [1, num_heads, length, head_dim]
        out[first:end] = attended[0].transpose(0, 1)
