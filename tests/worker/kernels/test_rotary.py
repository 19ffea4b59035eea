"""rotary_embedding (Triton) vs rotary_embedding_ref (torch) and layers.rotary."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.rotary import rotary_embedding, rotary_embedding_ref
from vtllm.worker.layers.rotary import cos_sin_table, inverse_frequencies, rope_cos_sin

from .marks import assert_close, gpu

MAX_POSITION = 4096


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half formula as Hugging Face writes it, for an independent check."""
    x1, x2 = x.chunk(2, dim=-1)  # each [num_tokens, num_heads, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _cos_sin_cache(rotary_dim: int, device: torch.device) -> torch.Tensor:
    params = {"rope_type": "default", "rope_theta": 10000.0}
    return cos_sin_table(rotary_dim, MAX_POSITION, params).to(device)  # [MAX_POSITION, r]


def _qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, generator):
    """q and k as strided views of a fused qkv output, as the model hands them over."""
    num_rows = num_heads + 2 * num_kv_heads
    qkv = torch.randn(num_tokens, num_rows, head_dim, generator=generator).to(device, dtype)
    return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]


def _check(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, generator):
    q, k = _qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, generator)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator).to(device)
    cache = _cos_sin_cache(rotary_dim, device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    q_before, k_before = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache)
    assert_close(q, q_ref, "q")
    assert_close(k, k_ref, "k")
    assert torch.equal(q[..., rotary_dim:], q_before[..., rotary_dim:])  # pass-through dims
    assert not torch.equal(q[..., :rotary_dim], q_before[..., :rotary_dim])
    return q_before, k_before, q, k, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(6, 2, 80, 80), (3, 3, 64, 64), (5, 1, 96, 32)],  # last: partial rotary
)
def test_matches_reference(num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, generator):
    _check(7, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, generator)


def test_matches_rope_layer(device, generator):
    q_before, k_before, q, k, positions = _check(5, 4, 2, 48, 48, torch.float32, device, generator)
    inv_freq = inverse_frequencies(48, {"rope_type": "default", "rope_theta": 10000.0})
    cos, sin = rope_cos_sin(positions, inv_freq.to(device), torch.float32)
    assert_close(q, apply_rope(q_before, cos, sin), "q vs layers.rotary.apply_rope")
    assert_close(k, apply_rope(k_before, cos, sin), "k vs layers.rotary.apply_rope")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(32, 8, 128, 128), (28, 4, 128, 128), (8, 4, 256, 256), (32, 32, 80, 40)],
)
def test_gpu_matches_reference(num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device):
    generator = torch.Generator().manual_seed(5)
    _check(3001, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device, generator)
