"""The native CPU decode-attention kernel (``worker/cpu_decode_kernel.py``) against the
torch path it replaces (``cpu_compile.cpu_decode_attention`` with the kernel off): the
same cache writes, outputs within float32 rounding, and a refusal (None, nothing
written) where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtllm.worker import cpu_compile, cpu_decode_kernel, native_build

pytestmark = pytest.mark.skipif(
    not cpu_decode_kernel.available(), reason="no C compiler to build the kernel here"
)


def _step(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """A decode step's tensors: q/k/v as row-strided views of one qkv product, caches of
    random keys, each request's blocks in random order."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = 64
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    num_reqs = len(seq_lens)
    width = max(-(-n // block_size) for n in seq_lens)
    tables = np.zeros((num_reqs, width), dtype=np.int32)
    order = rng.permutation(num_blocks)
    for r, n in enumerate(seq_lens):
        used = -(-n // block_size)
        tables[r, :used] = order[r * width : r * width + used]
    slots = np.array(
        [tables[r, (n - 1) // block_size] * block_size + (n - 1) % block_size
         for r, n in enumerate(seq_lens)],
        dtype=np.int64,
    )  # fmt: skip
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_reqs, q_size + 2 * kv_size, generator=gen)
    q = qkv[:, :q_size].view(num_reqs, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_reqs, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_reqs, num_kv_heads, head_dim)
    inputs = cpu_compile.decode_inputs(
        np.array(seq_lens, dtype=np.int64), tables, slots, block_size, torch.float32
    )
    return q, k, v, k_cache, v_cache, inputs


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads, head_dim, block_size",
    [
        ([70], 9, 3, 64, 16),  # the embedded SmolLM2's heads
        ([1], 9, 3, 64, 16),  # the first key only
        ([33, 5], 8, 2, 128, 4),  # partial blocks, two requests
        ([17, 64, 2], 4, 4, 32, 16),  # no grouping
        ([9, 40], 6, 2, 20, 16),  # a head dimension not a multiple of 8: plain C
        ([30, 3], 64, 4, 32, 8),  # 16 query heads a KV head: two KV heads a call
    ],
)
@pytest.mark.parametrize("build", ["native", "plain-c"])
@pytest.mark.parametrize("spread", [1.0, 40.0], ids=["scores", "wide-scores"])
def test_matches_the_torch_path(
    monkeypatch, seq_lens, heads, kv_heads, head_dim, block_size, build, spread
):
    """Within float32 rounding of the torch path, in this CPU's build and the plain-C
    one, with scores of ordinary spread and with some whose exponentials underflow."""
    q, k, v, k_cache, v_cache, (slots, tables, lens, mask) = _step(
        seq_lens, heads, kv_heads, head_dim, block_size
    )
    q = q * spread
    library = native_build.build(("-mno-avx2", "-mno-fma")) if build == "plain-c" else None
    caches = (k_cache.clone(), v_cache.clone())
    monkeypatch.setattr(cpu_compile, "NATIVE_MAX_REQS", 0)  # the torch path
    expected = cpu_compile.cpu_decode_attention(
        q, k, v, k_cache, v_cache, slots, tables, lens, mask, 0.125
    )
    native = cpu_decode_kernel.decode_attention(
        q, k, v, *caches, slots, tables, lens, 0.125, library
    )
    assert native is not None
    torch.testing.assert_close(native, expected, atol=2e-6 * spread, rtol=1e-5)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


def test_cpu_decode_attention_takes_the_kernel_for_one_request(monkeypatch):
    calls = []
    real = cpu_decode_kernel.decode_attention

    def counting(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_decode_kernel, "decode_attention", counting)
    for seq_lens in ([70], [70, 3, 9]):  # one request, then more than NATIVE_MAX_REQS
        q, k, v, k_cache, v_cache, inputs = _step(seq_lens, 9, 3, 64, 16)
        cpu_compile.cpu_decode_attention(q, k, v, k_cache, v_cache, *inputs, 0.125)
    assert calls == [1]


def test_refuses_what_it_does_not_take_and_writes_nothing():
    q, k, v, k_cache, v_cache, (slots, tables, lens, _) = _step([20], 8, 2, 64, 16)
    before = k_cache.clone()
    bf16 = cpu_decode_kernel.decode_attention(
        q.bfloat16(), k, v, k_cache.bfloat16(), v_cache.bfloat16(), slots, tables, lens, 0.1
    )
    assert bf16 is None
    q, k, v, k_cache, v_cache, (slots, tables, lens, _) = _step([20], 64, 1, 16, 16)
    before = k_cache.clone()
    assert (
        cpu_decode_kernel.decode_attention(q, k, v, k_cache, v_cache, slots, tables, lens, 0.1)
        is None
    )  # a group of 64 query heads: more than the kernel holds
    assert torch.equal(k_cache, before)
