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
group (chunks, possibly continuing a cached prefix); each group is padded to its longest
query and attended with one ``scaled_dot_product_attention`` call, so there is no Python
loop over requests or tokens.

Sliding window ``w`` (Mistral, Gemma 3 local layers): the query at position ``p`` sees only
keys ``p - w + 1 .. p``. Keys further back stay in the cache (no block is freed for a
window); they are masked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vtllm.worker.kv_cache_dtype import is_fp8


@dataclass
class AttentionGroup:
    """Requests attended together as one padded batch.

    ``token_idx`` are the group's tokens in the flat step order; ``padded_idx`` their
    places in the padded ``[num_reqs * max_query_len]`` layout.
    """

    num_reqs: int
    max_query_len: int
    token_idx: torch.Tensor  # [num_group_tokens] int64
    padded_idx: torch.Tensor  # [num_group_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64 (0-padded)
    mask: torch.Tensor  # [num_reqs, 1, max_query_len, max_num_blocks * block_size] bool
    query_pos: torch.Tensor  # [num_reqs, max_query_len] int64 position of each query row
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``mask`` with keys at position ``<= query_pos - sliding_window`` also hidden
        (built once per window size per step, then shared by the layers that use it)."""
        if not sliding_window:
            return self.mask
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            in_window = key_pos[None, None, :] > self.query_pos[:, :, None] - sliding_window
            mask = self.mask & in_window.unsqueeze(1)
            self._window_masks[sliding_window] = mask
        return mask


@dataclass
class KernelInputs:
    """The Triton kernels' view of a step (``kernels/paged_attention.py``)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32
    max_seq_len: int | None  # host-side hint for the split-KV heuristic
    num_kv_splits: int | None = None  # forced split count (graphs fix it at capture)


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


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    backend: str = "torch",
) -> AttentionMetadata:
    """Metadata for requests whose tokens are laid out back to back in step order.

    Request ``r`` computes its tokens ``seq_lens[r] - query_lens[r] .. seq_lens[r] - 1``;
    its block table must cover ``seq_lens[r]`` tokens. ``backend``: "torch" (reference,
    any device) or "triton" (GPU kernels).
    """
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(query_lens_np)[:-1])).astype(np.int64)
    slots = []
    for r, table in enumerate(block_tables):
        positions = np.arange(seq_lens_np[r] - query_lens_np[r], seq_lens_np[r])
        table_np = np.asarray(table, dtype=np.int64)
        if len(table_np) * block_size < seq_lens_np[r]:
            raise ValueError(
                f"block table of {len(table_np)} blocks cannot hold {seq_lens_np[r]} tokens"
            )
        slots.append(table_np[positions // block_size] * block_size + positions % block_size)
    slot_mapping = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    if backend == "triton":
        return AttentionMetadata(
            torch.from_numpy(slot_mapping).to(device),
            [],
            backend,
            _kernel_inputs(query_lens_np, seq_lens_np, block_tables, device),
        )
    is_decode = query_lens_np == 1
    groups = [
        _build_group(
            np.flatnonzero(members),
            query_lens_np,
            seq_lens_np,
            starts,
            block_tables,
            block_size,
            device,
        )
        for members in (is_decode, ~is_decode)
        if members.any()
    ]
    return AttentionMetadata(torch.from_numpy(slot_mapping).to(device), groups)


def _kernel_inputs(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: Sequence[Sequence[int]],
    device: torch.device,
) -> KernelInputs:
    num_reqs = len(seq_lens)
    max_blocks = max((len(t) for t in block_tables), default=1) or 1
    tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    for r, table in enumerate(block_tables):
        tables[r, : len(table)] = table
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    return KernelInputs(
        query_start_loc=torch.from_numpy(query_start_loc).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=torch.from_numpy(tables).to(device, non_blocking=True),
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
    )


def _build_group(
    reqs: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    starts: np.ndarray,
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    q_lens = query_lens[reqs]
    s_lens = seq_lens[reqs]
    max_q = int(q_lens.max())
    max_blocks = int(-(-s_lens.max() // block_size))
    tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
    for row, r in enumerate(reqs):
        needed = -(-seq_lens[r] // block_size)
        tables[row, :needed] = block_tables[r][:needed]
    token_idx = np.concatenate([np.arange(starts[r], starts[r] + query_lens[r]) for r in reqs])
    padded_idx = np.concatenate([row * max_q + np.arange(q) for row, q in enumerate(q_lens)])
    # query i of a request sits at position seq_len - q_len + i and sees keys 0..position;
    # padded query rows sit past seq_len and see all real keys (never an empty row).
    key_pos = torch.arange(max_blocks * block_size, device=device)
    query_pos = (
        torch.from_numpy(s_lens - q_lens).to(device)[:, None]
        + torch.arange(max_q, device=device)[None, :]
    )  # [num_reqs, max_q]
    s_lens_t = torch.from_numpy(s_lens).to(device)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (
        key_pos[None, None, :] < s_lens_t[:, None, None]
    )
    return AttentionGroup(
        num_reqs=len(reqs),
        max_query_len=max_q,
        token_idx=torch.from_numpy(token_idx).to(device),
        padded_idx=torch.from_numpy(padded_idx).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        mask=mask.unsqueeze(1),
        # padded rows get the last real position, so a window never empties them either
        query_pos=torch.minimum(query_pos, s_lens_t[:, None] - 1),
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
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for g in metadata.groups:
        num_reqs, max_q = g.num_reqs, g.max_query_len
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim)
        q_pad.index_copy_(0, g.padded_idx, q.index_select(0, g.token_idx))
        # fold the query heads that share a KV head into the query-length axis:
        # [R, Lq, KVH, G, D] -> [R, KVH, Lq * G, D]
        q_pad = (
            q_pad.view(num_reqs, max_q, num_kv_heads, group_size, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(num_reqs, num_kv_heads, max_q * group_size, head_dim)
        )
        k = _gather_blocks(k_cache, g.block_tables)  # [R, KVH, Lk, D]
        v = _gather_blocks(v_cache, g.block_tables)
        num_keys = k.shape[2]
        mask = g.window_mask(sliding_window)
        if group_size > 1:
            mask = mask.unsqueeze(3).expand(num_reqs, 1, max_q, group_size, num_keys)
            mask = mask.reshape(num_reqs, 1, max_q * group_size, num_keys)
        o = F.scaled_dot_product_attention(q_pad, k.to(q.dtype), v.to(q.dtype), mask, scale=scale)
        o = (
            o.view(num_reqs, num_kv_heads, max_q, group_size, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(num_reqs * max_q, num_heads, head_dim)
        )
        out.index_copy_(0, g.token_idx, o.index_select(0, g.padded_idx))
    return out


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, bs, KVH, D]`` by ``[R, nb]`` tables → ``[R, KVH, nb * bs, D]``."""
    num_reqs, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache[block_tables]  # [R, nb, bs, KVH, D]
    return gathered.view(num_reqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # [] fp32: the layer's scales, for FP8 caches
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention every model calls: the Triton kernel when the metadata was built for
    it (on a CPU tensor: the kernel's own torch reference, same contract), else the
    padded-batch torch reference. FP8 caches need the former (the worker refuses
    ``--kv-cache-dtype fp8`` otherwise)."""
    if metadata.backend == "triton":
        from vtllm.worker.kernels import paged_attention as kernels

        inputs = metadata.kernel_inputs
        assert inputs is not None
        kernel = kernels.paged_attention if q.is_cuda else kernels.paged_attention_ref
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
        )
    if is_fp8(k_cache.dtype):
        raise ValueError("an FP8 KV cache needs the Triton attention metadata (backend triton)")
    return paged_attention_ref(q, k_cache, v_cache, metadata, scale, sliding_window)
