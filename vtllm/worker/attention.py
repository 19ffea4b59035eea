"""Paged attention: KV written by slot, read back through each request's block table.

KV cache of one layer: ``k_cache`` and ``v_cache``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a request lives in
slot ``block_ids[t // block_size] * block_size + t % block_size``::

    block table [7, 2, 9], block_size 4, seq_len 10
    token:  0 1 2 3 | 4 5 6 7 | 8 9
    block:  7       | 2       | 9
    slot:  28 ... 31| 8 ... 11| 36 37

This file holds the plain-torch reference (``paged_attention_ref``), used on CPU and as
the oracle for the Triton kernels that will sit behind ``paged_attention``.

Batching: requests are split into a decode group (one query token each) and a prefill
group (chunks, possibly continuing a cached prefix). The decodes are one padded batch, one
``scaled_dot_product_attention`` call per layer. Each prefill chunk is attended on its own
(a step holds few of them) over exactly its own keys, gathered from its blocks: a first
chunk is plain causal attention (no mask), a later one takes a ``[q_len, seq_len]`` mask
built once per step; nothing grows with the padded batch (``q_len x max keys x requests``).

Sliding window ``w`` (Mistral, Gemma 3 local layers): the query at position ``p`` sees only
keys ``p - w + 1 .. p``. Keys further back stay in the cache (no block is freed for a
window); they are masked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from vtllm import envs
from vtllm.worker.block_table import slot_mapping_of, token_layout
from vtllm.worker.first_chunk_attention import (
    attend_first_chunks,
    default_min_tokens,
    trailing_first_chunks,
)
from vtllm.worker.kv_cache_dtype import is_fp8

if TYPE_CHECKING:
    from vtllm.worker.kernels.decode_prep import DecodePrep


@dataclass
class AttentionGroup:
    """Requests attended together by the torch reference.

    Decode group (every query length 1): one padded batch, keys gathered up to the longest
    sequence, the padding masked. Prefill group: one request at a time, each chunk over
    exactly its own keys (no padding, and no mask at all for a first chunk: plain causal).
    ``token_starts[r]`` is request ``r``'s first token in the flat step order.
    """

    num_reqs: int
    max_query_len: int
    token_idx: torch.Tensor  # [num_group_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64 (0-padded)
    block_size: int
    query_lens: list[int]
    seq_lens: list[int]
    token_starts: list[int]
    _masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def decode_mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``[num_reqs, 1, 1, num_keys]`` additive mask hiding the padding keys past each
        sequence (and, with a window, keys ``<= pos - window``); None when nothing needs
        hiding. Built once per step per window and dtype, shared by the layers."""
        key = ("decode", sliding_window, dtype)
        if key not in self._masks:
            num_keys = self.block_tables.shape[1] * self.block_size
            seq_lens = torch.tensor(self.seq_lens, device=self.token_idx.device)[:, None]
            key_pos = torch.arange(num_keys, device=seq_lens.device)[None, :]
            hidden = key_pos >= seq_lens
            if sliding_window:
                hidden |= key_pos <= seq_lens - 1 - sliding_window
            self._masks[key] = _additive(hidden, dtype)[:, None, None, :] if hidden.any() else None
        return self._masks[key]

    def chunk_mask(
        self, r: int, sliding_window: int | None, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``[q_len, seq_len]`` additive mask of prefill request ``r``: query ``i`` (at
        position ``seq_len - q_len + i``) sees keys up to its position, within the window.
        None for a first chunk without a window (plain causal attention serves it)."""
        q_len, seq_len = self.query_lens[r], self.seq_lens[r]
        if seq_len == q_len and not sliding_window:
            return None
        key = (r, sliding_window, dtype)
        if key not in self._masks:
            device = self.token_idx.device
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
            key_pos = torch.arange(seq_len, device=device)[None, :]
            hidden = key_pos > query_pos
            if sliding_window:
                hidden |= key_pos <= query_pos - sliding_window
            self._masks[key] = _additive(hidden, dtype)
        return self._masks[key]


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf where hidden (SDPA's CPU flash kernel takes it as is)."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf")
    )


# The Triton kernels' block tables are this many blocks wide, or a multiple: the row stride
# is a kernel argument, and Triton compiles a kernel again for each class of an integer
# argument's value (1, a multiple of 16, any other), so a width that followed the step's
# longest sequence would make a fresh engine compile the attention kernel again
# mid-load, whenever that width first crossed into another class.
KERNEL_TABLE_WIDTH_MULTIPLE = 16


@dataclass
class KernelInputs:
    """The Triton kernels' view of a step (``kernels/paged_attention.py``)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, width] int32, width a multiple of 16, 0-padded
    max_seq_len: int | None  # host-side hint for the split-KV heuristic
    num_kv_splits: int | None = None  # forced split count (graphs fix it at capture)
    # a trailing run of long first chunks for flash attention (first_chunk_attention.py):
    # its first request, and per request (request, first token, end token)
    first_chunks_from: int | None = None
    first_chunks: tuple[tuple[int, int, int], ...] = ()


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers.

    ``backend`` "torch": ``groups`` (padded batches for the reference); "triton":
    ``kernel_inputs`` (the kernels read block tables directly, no padding).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    groups: list[AttentionGroup]
    backend: str = "torch"
    kernel_inputs: KernelInputs | None = None
    # torch backend: prefill chunks attended in this dtype (q, k, v cast, the output cast
    # back; cpu_precision.py); None: the query's
    chunk_dtype: torch.dtype | None = None


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    backend: str = "torch",
    first_chunk_min_tokens: int | None | str = "auto",
    chunk_dtype: torch.dtype | None = None,
) -> AttentionMetadata:
    """Metadata for requests whose tokens are laid out back to back in step order, from
    plain lists (tests, the start-up dummy run; steps use ``attention_metadata`` on the
    worker's persistent arrays).

    Request ``r`` computes its tokens ``seq_lens[r] - query_lens[r] .. seq_lens[r] - 1``;
    its block table must cover ``seq_lens[r]`` tokens (ValueError otherwise).
    ``backend``: "torch" (reference, any device) or "triton" (GPU kernels).
    """
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    for table, seq_len in zip(block_tables, seq_lens_np.tolist(), strict=True):
        if len(table) * block_size < seq_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens")
    tables = np.zeros((len(block_tables), max((len(t) for t in block_tables), default=0)), np.int32)
    for r, table in enumerate(block_tables):
        tables[r, : len(table)] = table
    query_start_loc, token_reqs, positions = token_layout(query_lens_np, seq_lens_np)
    slots = slot_mapping_of(tables, token_reqs, positions, block_size)
    return attention_metadata(
        query_lens_np,
        seq_lens_np,
        query_start_loc,
        tables,
        slots,
        block_size,
        device,
        backend,
        first_chunk_min_tokens,
        chunk_dtype,
    )


def attention_metadata(
    query_lens: np.ndarray,  # [num_reqs] int64
    seq_lens: np.ndarray,  # [num_reqs] int64
    query_start_loc: np.ndarray,  # [num_reqs + 1] int32, cumulative query_lens
    block_tables: np.ndarray,  # [num_reqs, max_num_blocks] int32, covering seq_lens
    slot_mapping: np.ndarray,  # [num_tokens] int64
    block_size: int,
    device: torch.device,
    backend: str = "torch",
    first_chunk_min_tokens: int | None | str = "auto",
    chunk_dtype: torch.dtype | None = None,
) -> AttentionMetadata:
    """The metadata of a step from its host arrays (``StepBatch`` holds them), with no
    loop over requests: numpy gathers, then one host→device copy per tensor.

    Entries of ``block_tables`` past the blocks a request needs may hold any valid block
    id (0 or blocks allocated ahead): nothing reads keys past a request's ``seq_len``.
    ``first_chunk_min_tokens`` (triton backend): the shortest first chunk a trailing run
    sends to flash attention ("auto": ``first_chunk_attention.default_min_tokens``; None:
    none). ``chunk_dtype`` (torch backend): the dtype prefill chunks are attended in
    (None: the query's).
    """
    # non_blocking, as the kernel inputs below: a blocking copy would wait for the device
    # to finish the step before (async scheduling queues this one behind it)
    slots = torch.from_numpy(slot_mapping).to(device, non_blocking=True)
    if backend == "triton":
        inputs = _kernel_inputs(query_start_loc, seq_lens, block_tables, device)
        if first_chunk_min_tokens == "auto":
            first_chunk_min_tokens = default_min_tokens(device)
        start, segments = trailing_first_chunks(
            query_lens, seq_lens, query_start_loc, first_chunk_min_tokens
        )
        if segments:
            inputs.first_chunks_from, inputs.first_chunks = start, segments
        return AttentionMetadata(slots, [], backend, inputs)
    is_decode = query_lens == 1
    groups = [
        _build_group(
            np.flatnonzero(members),
            query_lens,
            seq_lens,
            query_start_loc,
            block_tables,
            block_size,
            device,
        )
        for members in (is_decode, ~is_decode)
        if members.any()
    ]
    return AttentionMetadata(slots, groups, chunk_dtype=chunk_dtype)


def _kernel_inputs(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    device: torch.device,
) -> KernelInputs:
    num_reqs = len(seq_lens)
    num_blocks = block_tables.shape[1]
    width = max(1, -(-num_blocks // KERNEL_TABLE_WIDTH_MULTIPLE)) * KERNEL_TABLE_WIDTH_MULTIPLE
    if num_blocks == width:
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    else:  # one copy, 0-padded: block 0 is valid, and nothing reads past a row
        tables = np.zeros((num_reqs, width), dtype=np.int32)
        tables[:, :num_blocks] = block_tables
    return KernelInputs(
        query_start_loc=torch.from_numpy(query_start_loc).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=torch.from_numpy(tables).to(device, non_blocking=True),
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
    )


def _build_group(
    reqs: np.ndarray,  # [group_reqs] indices into the step's requests
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    q_lens = query_lens[reqs]
    s_lens = seq_lens[reqs]
    starts = query_start_loc[reqs].astype(np.int64)
    max_blocks = int(-(-s_lens.max() // block_size))
    tables = block_tables[reqs, :max_blocks].astype(np.int64)
    if len(q_lens) == int(q_lens.sum()):  # one token each (the decode group)
        token_idx = starts
    else:  # starts[r] .. starts[r] + q_lens[r] - 1, back to back
        ends = np.cumsum(q_lens)
        token_idx = np.repeat(starts - ends + q_lens, q_lens) + np.arange(ends[-1])
    return AttentionGroup(
        num_reqs=len(reqs),
        max_query_len=int(q_lens.max()),
        token_idx=torch.from_numpy(token_idx).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        block_size=block_size,
        query_lens=q_lens.tolist(),
        seq_lens=s_lens.tolist(),
        token_starts=starts.tolist(),
    )


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: torch.Tensor | None = None,  # [] fp32: the layer's scales, for FP8 caches
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store this step's K/V at their slots (quantised with the scales into an FP8
    cache, see ``kv_cache_dtype.py``)."""
    if k_cache.is_cuda or is_fp8(k_cache.dtype):  # CUDA and ROCm alike; FP8 caches
        from vtllm.worker.kernels import reshape_and_cache as kernels

        write = kernels.reshape_and_cache if k_cache.is_cuda else kernels.reshape_and_cache_ref
        write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    slot_mapping = slot_mapping.long()
    if len(slot_mapping) and int(slot_mapping.min()) < 0:  # padding rows (-1) are not written
        real = slot_mapping >= 0
        k, v, slot_mapping = k[real], v[real], slot_mapping[real]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its cached keys (plain torch).

    The current step's K/V must already be written (``write_kv_cache``). Query head ``h``
    uses KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention). With
    ``sliding_window`` the query at position ``p`` sees keys ``p - sliding_window + 1 .. p``.
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    for g in metadata.groups:
        if g.is_decode:
            o = _attend_decodes(
                q.index_select(0, g.token_idx), k_cache, v_cache, g, scale, sliding_window
            )
            out.index_copy_(0, g.token_idx, o)
            continue
        for r in range(g.num_reqs):
            start, q_len = g.token_starts[r], g.query_lens[r]
            out[start : start + q_len] = _attend_chunk(
                q[start : start + q_len],
                k_cache,
                v_cache,
                g,
                r,
                scale,
                sliding_window,
                metadata.chunk_dtype,
            )
    return out


def _attend_decodes(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]: one query token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttentionGroup,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One padded batch: the query heads sharing a KV head take the query-length axis,
    ``[R, H, D] -> [R, KVH, G, D]``, against keys ``[R, KVH, nb * bs, D]``."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather_blocks(k_cache, g.block_tables)  # [R, KVH, Lk, D]
    v = _gather_blocks(v_cache, g.block_tables)
    if num_reqs == 1 and not sliding_window:  # keys past the sequence cut off, no mask
        k, v, mask = k[:, :, : g.seq_lens[0]], v[:, :, : g.seq_lens[0]], None
    else:
        mask = g.decode_mask(sliding_window, q.dtype)  # [R, 1, 1, Lk] or None
    q = q.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), mask, scale=scale)
    return o.reshape(num_reqs, num_heads, head_dim)


def _attend_chunk(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]: request r's chunk
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttentionGroup,
    r: int,
    scale: float,
    sliding_window: int | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Request ``r``'s prefill chunk over exactly its ``seq_len`` keys (gathered from its
    blocks): causal when the chunk is the whole sequence, else with ``chunk_mask``;
    computed in ``dtype`` (None: the query's), returned in the query's."""
    dtype = dtype or q.dtype
    seq_len = g.seq_lens[r]
    table = g.block_tables[r, : -(-seq_len // g.block_size)]
    k = _gather_blocks(k_cache, table[None])[:, :, :seq_len]  # [1, KVH, seq_len, D]
    v = _gather_blocks(v_cache, table[None])[:, :, :seq_len]
    mask = g.chunk_mask(r, sliding_window, dtype)  # [q_len, seq_len] or None
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(dtype),  # [1, H, q_len, D]
        k.to(dtype),
        v.to(dtype),
        mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).to(q.dtype)  # [q_len, H, D]


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, bs, KVH, D]`` by ``[R, nb]`` tables → ``[R, KVH, nb * bs, D]`` (a
    transposed view of one copy of the blocks)."""
    num_reqs, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    # whole blocks as rows of a 2-D view: a row copy each (4-D index_select is slower)
    rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    gathered = rows.view(num_reqs * num_blocks, block_size, num_kv_heads, head_dim)
    return gathered.view(num_reqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _attend_with_first_chunks(
    kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inputs, scale: float
) -> torch.Tensor:
    """The paged kernel on the requests before the trailing run of long first chunks (a
    prefix of its inputs, their tokens only), flash attention on each of the run."""
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    start = inputs.first_chunks_from
    if start:
        num_tokens = inputs.first_chunks[0][1]  # the run's first token: the prefix's end
        kernel(
            q[:num_tokens],
            k_cache,
            v_cache,
            inputs.query_start_loc[: start + 1],
            inputs.seq_lens[:start],
            inputs.block_tables[:start],
            scale,
            None,
            max_seq_len=None,  # the run's long prompts would skew the split heuristic
            out=out[:num_tokens],
        )
    attend_first_chunks(q, k_cache, v_cache, inputs.block_tables, inputs.first_chunks, scale, out)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # [] fp32: the layer's scales, for FP8 caches
    v_scale: torch.Tensor | None = None,
    prep: DecodePrep | None = None,
) -> torch.Tensor:
    """The attention every model calls: the Triton kernel when the metadata was built for
    it (on a CPU tensor: the kernel's own torch reference, same contract), else the
    padded-batch torch reference. FP8 caches need the former (the worker refuses
    ``--kv-cache-dtype fp8`` otherwise).

    With ``prep`` (GPU, Triton metadata), ``q`` is the qkv projection and the step's k/v
    are not stored yet: decode-only steps run ``kernels/qkv_prep.py``'s work inside the
    attention kernel (``VT_DECODE_FUSED_PREP``), other steps run ``qkv_prep`` first."""
    if prep is not None:
        inputs = metadata.kernel_inputs
        fused = (
            envs.VT_DECODE_FUSED_PREP != "off"
            and q.is_cuda
            and inputs is not None
            and not inputs.first_chunks
        )  # the kernel itself runs qkv_prep first on steps that are not decode-only
        if not fused:
            num_kv_heads, head_dim = k_cache.shape[2:]
            q = prep.run_qkv_prep(q, num_kv_heads, head_dim, k_cache, v_cache, k_scale, v_scale)
            prep = None
    if metadata.backend == "triton":
        from vtllm.worker.kernels import paged_attention as kernels

        inputs = metadata.kernel_inputs
        assert inputs is not None
        kernel = kernels.paged_attention if q.is_cuda else kernels.paged_attention_ref
        if inputs.first_chunks and sliding_window is None and not is_fp8(k_cache.dtype):
            return _attend_with_first_chunks(kernel, q, k_cache, v_cache, inputs, scale)
        extra = {} if prep is None else {"prep": prep}
        return kernel(
            q,
            k_cache,
            v_cache,
            inputs.query_start_loc,
            inputs.seq_lens,
            inputs.block_tables,
            scale,
            sliding_window,
            max_seq_len=inputs.max_seq_len,
            num_kv_splits=inputs.num_kv_splits,
            k_scale=k_scale,
            v_scale=v_scale,
            **extra,
        )
    if is_fp8(k_cache.dtype):
        raise ValueError("an FP8 KV cache needs the Triton attention metadata (backend triton)")
    return paged_attention_ref(q, k_cache, v_cache, metadata, scale, sliding_window)
