"""FP8 KV cache in the kernels: ``reshape_and_cache`` quantises with the layer's scale,
``paged_attention`` reads e4m3 and dequantises. The oracle is the plain torch reference
run on the cache dequantised to fp32 (``float(cache) * scale``), never the kernel.

Both e4m3 variants run on every device: OCP ``float8_e4m3fn`` (NVIDIA, gfx950, gfx12) and
``float8_e4m3fnuz`` (gfx942); on CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.paged_attention import paged_attention, paged_attention_ref
from vtllm.worker.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from vtllm.worker.kv_cache_dtype import dequantize_fp8_ref, quantize_fp8_ref
from vtllm.worker.platform import detect_platform

from .marks import assert_close, gpu
from .paged_batch import PagedBatch, make_paged_batch

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
ON_GPU = detect_platform().is_gpu


def _scalar(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # fp8 tensors have no torch.equal on CPU


def _check_write(batch: PagedBatch, fp8: torch.dtype, k_scale: float, v_scale: float) -> None:
    device = batch.q.device
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[::3] = -1  # padding tokens: never written
    k_cache = torch.zeros(batch.k_cache.shape, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    ks, vs = _scalar(k_scale, device), _scalar(v_scale, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(batch.k_new, batch.v_new, expected_k, expected_v, slot_mapping, ks, vs)
    reshape_and_cache(batch.k_new, batch.v_new, k_cache, v_cache, slot_mapping, ks, vs)
    kept = slot_mapping >= 0
    slots = slot_mapping[kept].long()
    per_slot = k_cache.shape[2:]
    for new, actual, expected, scale in (
        (batch.k_new, k_cache, expected_k, k_scale),
        (batch.v_new, v_cache, expected_v, v_scale),
    ):
        if ON_GPU:  # hardware conversion: the same rounding as torch's, bit for bit
            assert torch.equal(_bytes(actual), _bytes(expected))
        written = actual.view(-1, *per_slot)[slots]  # [num_kept, num_kv_heads, head_dim]
        oracle = expected.view(-1, *per_slot)[slots]
        scaled = new[kept].float() / scale  # what the cache should approximate
        # the oracle itself: x / scale to e4m3 precision
        torch.testing.assert_close(oracle.float(), scaled, rtol=2**-4, atol=2**-9)
        # Triton's interpreter (3.9) drops the carry when rounding reaches the next power
        # of two (1.97 -> 1.0, not 2.0) and rounds some subnormals differently: on CPU,
        # compare every other element, to the smallest subnormal
        carried = ((_bytes(oracle) & 0x7) == 0) & (oracle.float().abs() > scaled.abs())
        assert carried.float().mean() < 0.1
        torch.testing.assert_close(
            written.float()[~carried], oracle.float()[~carried], atol=2**-9, rtol=0
        )
        # nothing written anywhere else
        untouched = torch.ones(actual.view(-1, *per_slot).shape[0], dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert not _bytes(actual.view(-1, *per_slot)[untouched.to(device)]).any()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.25, 0.0371)])
def test_write_quantises_with_the_layer_scale(fp8, k_scale, v_scale, device, generator):
    batch = make_paged_batch([5, 1, 3], [0, 17, 30], 4, 2, 40, 8, torch.float32, device, generator)
    _check_write(batch, fp8, k_scale, v_scale)


@pytest.mark.parametrize("fp8", FP8)
def test_write_saturates_outliers(fp8, device):
    limit = torch.finfo(fp8).max
    k = torch.tensor([[[1e4, -1e4, 3.0, limit * 0.5]]], device=device)  # [1, 1, 4]
    k_cache = torch.zeros(2, 4, 1, 4, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    one = _scalar(1.0, device)
    reshape_and_cache(k, -k, k_cache, v_cache, torch.tensor([5], device=device), one, one)
    stored = k_cache.view(-1, 4)[5].float().cpu()
    assert stored.tolist() == [limit, -limit, 3.0, limit * 0.5]  # never inf or NaN
    assert (v_cache.view(-1, 4)[5].float().cpu() == -stored).all()


def test_an_fp8_cache_needs_its_scales(device):
    k = torch.zeros(1, 1, 16, device=device)
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        reshape_and_cache(k, k, cache, cache, slots)
    one = torch.ones(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_attention(k, cache, cache, torch.tensor([0, 1], device=device), one[0], one, 1.0)


def _quantised(batch: PagedBatch, fp8: torch.dtype, k_scale: float, v_scale: float):
    """The batch's caches in e4m3 (NaN slots stay NaN: a kernel reading one key too many
    still fails loudly) and their fp32 dequantisation, the oracle's input."""
    k8 = quantize_fp8_ref(batch.k_cache, k_scale, fp8)
    v8 = quantize_fp8_ref(batch.v_cache, v_scale, fp8)
    return k8, v8, dequantize_fp8_ref(k8, k_scale), dequantize_fp8_ref(v8, v_scale)


def _attend(batch: PagedBatch, k_cache, v_cache, fn, scale, window, **kwargs) -> torch.Tensor:
    return fn(
        batch.q,
        k_cache,
        v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        window,
        **kwargs,
    )


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(
    ("dtype", "num_kv_splits", "window"),
    [(torch.float32, 1, None), (torch.float16, 1, 7), (torch.float32, 4, None)],
)
def test_attention_reads_fp8_like_the_dequantised_reference(
    fp8, dtype, num_kv_splits, window, device, generator
):
    """Mixed prefill chunks and decodes (split over the keys when ``num_kv_splits`` > 1
    on decode-only rows), k and v with different, non-power-of-two scales."""
    q_lens, context_lens = (
        ([1, 1, 1], [99, 3, 40]) if num_kv_splits > 1 else ([5, 1, 9], [0, 13, 20])
    )
    batch = make_paged_batch(q_lens, context_lens, 4, 2, 48, 8, dtype, device, generator)
    k_scale, v_scale = 0.05, 0.3
    k8, v8, k_deq, v_deq = _quantised(batch, fp8, k_scale, v_scale)
    expected = _attend(batch, k_deq, v_deq, paged_attention_ref, 0.2, window).float()
    scales = dict(k_scale=_scalar(k_scale, device), v_scale=_scalar(v_scale, device))
    actual = _attend(
        batch, k8, v8, paged_attention, 0.2, window, num_kv_splits=num_kv_splits, **scales
    )
    assert actual.dtype == dtype
    assert_close(actual, expected.to(dtype), f"{fp8}, {num_kv_splits} splits")
    # the kernel's own reference dequantises the same way
    ref = _attend(batch, k8, v8, paged_attention_ref, 0.2, window, **scales)
    assert_close(ref, expected.to(dtype), "reference with scales")


def test_a_wrong_scale_is_visible(device, generator):
    """The oracle catches a kernel that ignores the scales."""
    batch = make_paged_batch([3, 1], [0, 20], 2, 1, 32, 8, torch.float32, device, generator)
    k8, v8, k_deq, v_deq = _quantised(batch, torch.float8_e4m3fn, 0.5, 0.5)
    expected = _attend(batch, k_deq, v_deq, paged_attention_ref, 0.3, None)
    one = _scalar(1.0, device)
    unscaled = _attend(batch, k8, v8, paged_attention, 0.3, None, k_scale=one, v_scale=one)
    assert (unscaled - expected).abs().max() > 0.1


# ---- GPU: realistic shapes -----------------------------------------------------------


@gpu
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 128), (16, 256), (32, 80)])
def test_gpu_write_is_bitwise_the_reference(block_size, head_dim, device):
    """The platform's e4m3 (Triton has no fnuz on NVIDIA, no OCP e4m3 on gfx942)."""
    fp8 = detect_platform().fp8_dtype
    generator = torch.Generator().manual_seed(5)
    batch = make_paged_batch(
        [900, 1, 1, 333, *([1] * 60)],
        [0, 4000, 17, 64, *range(100, 6100, 100)],
        8,
        8,
        head_dim,
        block_size,
        torch.bfloat16,
        device,
        generator,
    )
    _check_write(batch, fp8, 0.0625, 0.11)


@gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window"),
    [(32, 8, 128, None), (16, 8, 256, 1024), (32, 4, 128, None)],
)
@pytest.mark.parametrize("num_kv_splits", [None, 1, 8])
def test_gpu_attention_matches_the_dequantised_reference(
    num_heads, num_kv_heads, head_dim, window, num_kv_splits, device
):
    """bf16 queries over the platform's e4m3 cache: a mixed long-context step (prefill
    chunks and decodes), and decode-only batches that the launcher splits over the keys."""
    fp8 = detect_platform().fp8_dtype
    generator = torch.Generator().manual_seed(2)
    if num_kv_splits == 8:
        q_lens, context_lens = [1] * 4, [5000, 1, 3000, 8191]
    else:
        q_lens, context_lens = [700, 1, 1, 37, 1, 1200], [0, 5000, 1, 3000, 8191, 800]
    batch = make_paged_batch(
        q_lens,
        context_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        16,
        torch.bfloat16,
        device,
        generator,
        num_spare_blocks=64,
    )
    k8, v8, k_deq, v_deq = _quantised(batch, fp8, 0.02, 0.5)
    scale = head_dim**-0.5
    expected = _attend(batch, k_deq, v_deq, paged_attention_ref, scale, window)
    actual = _attend(
        batch,
        k8,
        v8,
        paged_attention,
        scale,
        window,
        max_seq_len=batch.max_seq_len,
        num_kv_splits=num_kv_splits,
        k_scale=_scalar(0.02, device),
        v_scale=_scalar(0.5, device),
    )
    assert_close(actual, expected, f"fp8 {num_heads}/{num_kv_heads}x{head_dim}")
