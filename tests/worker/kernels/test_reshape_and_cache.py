"""reshape_and_cache (Triton) vs reshape_and_cache_ref (torch)."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

from .marks import gpu
from .paged_batch import make_paged_batch


def _check(batch, cache_dtype: torch.dtype, pad_every: int) -> None:
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[::pad_every] = -1  # padding tokens
    k_cache = batch.k_cache.nan_to_num(0.5).to(cache_dtype)
    v_cache = batch.v_cache.nan_to_num(0.5).to(cache_dtype)
    # strided views, as sliced out of a fused [num_tokens, (kv + kv) * head_dim] output
    kv = torch.cat([batch.k_new, batch.v_new], dim=1)  # [num_tokens, 2 * num_kv_heads, D]
    num_kv_heads = batch.k_new.shape[1]
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(k, v, expected_k, expected_v, slot_mapping)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    # bitwise: a copy with one cast, and every other slot must keep its old value
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    kept = slot_mapping[slot_mapping >= 0]
    assert torch.equal(
        k_cache.view(-1, *k_cache.shape[2:])[kept], k[slot_mapping >= 0].to(cache_dtype)
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "head_dim"),
    [
        (torch.float32, torch.float32, 80),
        (torch.float16, torch.float16, 96),
        (torch.float32, torch.float16, 40),  # cast on store
    ],
)
def test_matches_reference(block_size, dtype, cache_dtype, head_dim, device, generator):
    batch = make_paged_batch(
        [5, 1, 3], [0, 17, 30], 2, 3, head_dim, block_size, dtype, device, generator
    )
    _check(batch, cache_dtype, pad_every=4)


def test_rejects_mismatched_cache(device):
    k = torch.zeros(2, 2, 16, device=device)
    cache = torch.zeros(4, 8, 2, 32, device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"cache holds \[2, 32\] per slot, k has \[2, 16\]"):
        reshape_and_cache(k, k, cache, cache, slots)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 128), (32, 80), (16, 256)])
def test_gpu_matches_reference(dtype, block_size, head_dim, device):
    generator = torch.Generator().manual_seed(3)
    batch = make_paged_batch(
        [900, 1, 1, 333, *([1] * 60)],
        [0, 4000, 17, 64, *range(100, 6100, 100)],
        8,
        8,
        head_dim,
        block_size,
        dtype,
        device,
        generator,
    )
    _check(batch, dtype, pad_every=7)
