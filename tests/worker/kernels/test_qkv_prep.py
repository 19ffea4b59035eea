"""qkv_prep (norm + rope + cache write in one kernel) vs the unfused torch sequence: q, the
cache contents, padding slots, partial rotary, both norm flavours and FP8 caches."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.qkv_prep import qkv_prep, qkv_prep_ref
from vtllm.worker.kernels.rms_norm import rms_norm_ref
from vtllm.worker.layers.rotary import cos_sin_table

from .marks import assert_close, gpu


def _problem(num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype, device, generator):
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    cache_shape = (6, 4, kv_heads, head_dim)  # 6 blocks of 4 slots
    slots = torch.randperm(24, generator=generator)[:num_tokens]
    slots[0] = -1  # a padding row: nothing stored
    positions = torch.randint(0, 64, (num_tokens,), generator=generator)
    table = cos_sin_table(rotary_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    weights = [1 + 0.1 * torch.randn(head_dim, generator=generator) for _ in range(2)]
    return (
        qkv.to(device, dtype),
        positions.to(device),
        table.to(device),
        [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(4)],
        slots.to(device),
        [w.to(device, dtype) for w in weights],
    )


@pytest.mark.parametrize(
    ("norm", "dtype", "shape"),
    [
        ("llama", torch.float32, (5, 4, 2, 32, 32)),  # Qwen3: q/k norm, full rotary
        ("none", torch.float16, (3, 6, 3, 24, 16)),  # Llama, partial rotary, odd head_dim
        ("gemma", torch.float32, (4, 2, 1, 16, 16)),  # Gemma 3: (1 + w)
    ],
)
def test_matches_unfused_sequence(norm, dtype, shape, device, generator):
    num_tokens, heads, kv_heads, head_dim, rotary_dim = shape
    qkv, positions, table, caches, slots, (wq, wk) = _problem(
        num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype, device, generator
    )
    before = qkv.clone()
    norms = {} if norm == "none" else dict(q_norm=wq, k_norm=wk, gemma_norm=norm == "gemma")
    args = (qkv, heads, kv_heads, head_dim, positions, table)
    q = qkv_prep(*args, caches[0], caches[1], slots, **norms)
    q_ref = qkv_prep_ref(*args, caches[2], caches[3], slots, **norms)
    assert q.shape == (num_tokens, heads, head_dim) and q.is_contiguous()
    assert torch.equal(qkv, before)  # the projection output is left alone
    assert_close(q, q_ref, "q")
    assert_close(caches[0], caches[2], "k cache")
    assert_close(caches[1], caches[3], "v cache")
    assert caches[0].flatten(0, 1)[slots[1:].long()].abs().sum() > 0  # written ...
    untouched = torch.ones(24, dtype=torch.bool, device=device)
    untouched[slots[1:].long()] = False
    assert caches[0].flatten(0, 1)[untouched].abs().sum() == 0  # ... and nothing else


@pytest.mark.parametrize("qk_norm", [True, False])
def test_input_stream_finishes_the_input_norm(qk_norm, device, generator):
    """With ``input_stream`` the projection was of ``stream * weight`` (the MoE decode
    chain): the kernel's 1/rms of each stream row gives what the unfused sequence gives
    from ``W rms_norm(stream)``: kernel vs reference at the dtype's tolerance, and the
    reference vs the unfused norm-then-project sequence within rounding."""
    heads, kv_heads, head_dim, hidden = 4, 2, 32, 48
    _, positions, table, caches, slots, (wq, wk) = _problem(
        5, heads, kv_heads, head_dim, head_dim, torch.float32, device, generator
    )
    stream = (3 * torch.randn(5, hidden, generator=generator)).to(device)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(device)
    w_qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=generator).to(device)
    norms = dict(q_norm=wq, k_norm=wk) if qk_norm else {}
    args = (heads, kv_heads, head_dim, positions, table)
    folded = (stream * norm_weight) @ w_qkv.T  # the projection of the un-normed stream
    chained = dict(input_stream=stream, input_eps=1e-5)
    q = qkv_prep(folded, *args, caches[0], caches[1], slots, **norms, **chained)
    q_ref = qkv_prep_ref(folded, *args, caches[2], caches[3], slots, **norms, **chained)
    assert_close(q, q_ref, "q")
    assert_close(caches[0], caches[2], "k cache")
    assert_close(caches[1], caches[3], "v cache")
    normed = rms_norm_ref(stream, norm_weight, 1e-5)[0]
    unfused_caches = [torch.zeros_like(caches[0]) for _ in range(2)]
    q_unfused = qkv_prep_ref(normed @ w_qkv.T, *args, *unfused_caches, slots, **norms)
    assert_close(q_ref, q_unfused, "q vs the unfused sequence")
    assert_close(caches[3], unfused_caches[1], "v vs the unfused sequence")
    with pytest.raises(ValueError, match=r"input_stream \(4, 48\)"):
        qkv_prep(folded, *args, caches[0], caches[1], slots, input_stream=stream[:4])


def test_fp8_cache_quantises_with_the_layer_scales(device, generator):
    qkv, positions, table, _, slots, (wq, wk) = _problem(
        4, 4, 2, 32, 32, torch.float32, device, generator
    )
    caches = [torch.zeros(6, 4, 2, 32, dtype=torch.float8_e4m3fn, device=device) for _ in range(4)]
    scales = dict(
        k_scale=torch.tensor(0.05, device=device), v_scale=torch.tensor(0.02, device=device)
    )
    args = (qkv, 4, 2, 32, positions, table)
    q = qkv_prep(*args, caches[0], caches[1], slots, q_norm=wq, k_norm=wk, **scales)
    q_ref = qkv_prep_ref(*args, caches[2], caches[3], slots, q_norm=wq, k_norm=wk, **scales)
    assert_close(q, q_ref, "q")
    for actual, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        # e4m3 keeps 3 mantissa bits. Triton's interpreter drops the carry when rounding
        # reaches the next power of two (see test_fp8_kv_cache.py): a few elements differ
        # by one step there; on a GPU the conversion is torch's, bit for bit
        close = torch.isclose(actual.float(), expected.float(), rtol=0.07, atol=2**-9)
        assert close.float().mean() > 0.98, close.float().mean()
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        qkv_prep(*args, caches[0], caches[1], slots)


def test_bad_shapes_are_named(device):
    table = cos_sin_table(16, 8, {"rope_theta": 10000.0, "rope_type": "default"}).to(device)
    cache = torch.zeros(2, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match=r"expected \[num_tokens, 64\]"):
        qkv_prep(torch.zeros(2, 60, device=device), 2, 1, 16, torch.zeros(2, device=device),
                 table, cache, cache, torch.zeros(2, device=device))  # fmt: skip
    empty = qkv_prep(torch.zeros(0, 64, device=device), 2, 1, 16,
                     torch.zeros(0, dtype=torch.long, device=device), table, cache, cache,
                     torch.zeros(0, dtype=torch.long, device=device))  # fmt: skip
    assert empty.shape == (0, 2, 16)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_gpu_qwen3_shape_bf16(num_tokens, device):
    """Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128, q/k norm) in bf16: equal to
    the unfused kernels' torch twins to bf16 rounding, cache and q."""
    generator = torch.Generator().manual_seed(1)
    qkv, positions, table, _, _, (wq, wk) = _problem(
        num_tokens, 32, 4, 128, 128, torch.bfloat16, device, generator
    )
    caches = [torch.zeros(40, 16, 4, 128, dtype=torch.bfloat16, device=device) for _ in range(4)]
    slots = torch.randperm(640, device=device)[:num_tokens]
    args = (qkv, 32, 4, 128, positions, table)
    q = qkv_prep(*args, caches[0], caches[1], slots, q_norm=wq, k_norm=wk)
    q_ref = qkv_prep_ref(*args, caches[2], caches[3], slots, q_norm=wq, k_norm=wk)
    assert_close(q, q_ref, "q")
    assert_close(caches[0], caches[2], "k cache")
    assert torch.equal(caches[1], caches[3])  # v is copied as it is
