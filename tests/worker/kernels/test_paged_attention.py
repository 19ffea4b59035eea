"""paged_attention (Triton) vs paged_attention_ref (torch) on ragged mixed batches."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker import attention as torch_attention
from vtllm.worker.kernels.decode_prep import DecodePrep
from vtllm.worker.kernels.kv_splits import choose_num_kv_splits
from vtllm.worker.kernels.paged_attention import (
    AttentionTiles,
    choose_tiles,
    paged_attention,
    paged_attention_ref,
)
from vtllm.worker.kernels.qkv_prep import qkv_prep_ref
from vtllm.worker.kernels.reshape_and_cache import reshape_and_cache
from vtllm.worker.layers.rotary import cos_sin_table

from .marks import assert_close, gpu
from .paged_batch import PagedBatch, make_paged_batch

# q_lens / context_lens of a mixed step: a first prefill chunk, decodes (one at
# position 0), a chunk continuing a cached prefix that spans several query blocks, and
# a short chunk whose prefix ends mid-block.
MIXED_Q_LENS = [5, 1, 70, 1, 3, 1]
MIXED_CONTEXT_LENS = [0, 40, 9, 0, 17, 130]


def _attend(batch: PagedBatch, fn, scale: float, window: int | None, **kwargs) -> torch.Tensor:
    return fn(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        window,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("head_dim", "block_size", "dtype", "num_heads", "num_kv_heads", "window"),
    [
        (80, 16, torch.float16, 6, 2, None),  # non-power-of-two head_dim, GQA 3
        (96, 8, torch.float32, 4, 4, 7),  # MHA, small window, tiles span pages
        (64, 32, torch.float16, 8, 1, None),  # MQA, group 8
        (40, 16, torch.float32, 7, 1, None),  # group 7: rows that fit no token
        (128, 8, torch.float16, 4, 2, 16),
        (256, 16, torch.float32, 2, 1, 5),  # Gemma-sized head, narrower key tile
    ],
)
def test_mixed_batch_matches_reference(
    head_dim, block_size, dtype, num_heads, num_kv_heads, window, device, generator
):
    batch = make_paged_batch(
        MIXED_Q_LENS,
        MIXED_CONTEXT_LENS,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        device,
        generator,
    )
    scale = head_dim**-0.5
    expected = _attend(batch, paged_attention_ref, scale, window)
    actual = _attend(batch, paged_attention, scale, window, num_kv_splits=1)
    assert actual.shape == batch.q.shape and actual.dtype == dtype
    assert_close(actual, expected, "single pass")


@pytest.mark.parametrize(
    "tiles",
    [
        AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=1),
        AttentionTiles(block_m=128, tile_n=64, num_warps=8, num_stages=3),
    ],
    ids=["small", "large"],
)
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_any_launch_configuration_matches_reference(tiles, num_kv_splits, device, generator):
    """What a sweep tries: other query/key tiles, each with and without split-KV, over
    key tiles wholly visible (unmasked), on the diagonal and past a ragged end."""
    q_lens, context_lens = [1, 1, 37, 1], [150, 3, 90, 64]
    batch = make_paged_batch(q_lens, context_lens, 8, 2, 64, 16, torch.float32, device, generator)
    expected = _attend(batch, paged_attention_ref, 0.125, None)
    actual = _attend(batch, paged_attention, 0.125, None, num_kv_splits=num_kv_splits, tiles=tiles)
    assert_close(actual, expected, f"{tiles}, {num_kv_splits} splits")


@pytest.mark.parametrize("decode_prefetch", [False, True])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_only_batches_take_one_program_a_sequence(
    num_kv_splits, window, decode_prefetch, device, generator
):
    """As many tokens as sequences: program i is sequence i, no search; with
    ``decode_prefetch`` one masked loop over the tiles (several of them at 150 and 200
    keys) that loads the next tile's block ids ahead. The output is the reference's, and
    bit for bit what the numbered query blocks of mixed steps give."""
    batch = make_paged_batch(
        [1] * 6, [0, 31, 150, 7, 64, 200], 8, 2, 64, 16, torch.float32, device, generator
    )
    expected = _attend(batch, paged_attention_ref, 0.125, window)
    direct = _attend(
        batch, paged_attention, 0.125, window, num_kv_splits=num_kv_splits,
        decode_prefetch=decode_prefetch,
    )  # fmt: skip
    searched = _attend(
        batch, paged_attention, 0.125, window, num_kv_splits=num_kv_splits, search_sequences=True
    )
    assert_close(direct, expected, "one program a sequence")
    assert torch.equal(direct, searched)


@pytest.mark.parametrize(
    ("norm", "rotary_dim", "num_kv_splits", "window", "stream", "cache_dtype"),
    [
        ("llama", 64, 1, None, False, None),  # Qwen3: q/k norm
        ("llama", 64, 4, None, True, None),  # the MoE decode chain's input norm, split KV
        ("none", 32, 2, 40, False, None),  # Llama, partial rotary, a window
        ("gemma", 64, 1, None, False, None),
        ("llama", 64, 4, None, True, torch.float8_e4m3fn),  # FP8 cache: quantised k/v
    ],
)
def test_fused_prep_matches_qkv_prep_then_attention(
    norm, rotary_dim, num_kv_splits, window, stream, cache_dtype, device, generator
):
    """``prep=``: a decode-only step given the qkv projection: the kernel stores the
    step's k/v and attends as ``qkv_prep`` and then attention do (references of both),
    over sequences of 1 to 201 keys (the token's own key attended from registers, the
    rest from the cache); a padding row (slot -1) stores nothing."""
    heads, kv_heads, head_dim = 8, 2, 64
    batch = make_paged_batch(
        [1] * 6, [0, 31, 150, 7, 64, 200], heads, kv_heads, head_dim, 16, torch.float32,
        device, generator,
    )  # fmt: skip
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(6, width, generator=generator).to(device)
    positions = (batch.seq_lens - 1).long()
    table = cos_sin_table(rotary_dim, 256, {"rope_theta": 10000.0, "rope_type": "default"})
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=generator)).to(device) for _ in "qk"]
    slots = batch.slot_mapping.clone()
    slots[3] = -1  # a padding row
    prep = DecodePrep(
        heads, positions, table.to(device), slots,
        q_norm=None if norm == "none" else weights[0],
        k_norm=None if norm == "none" else weights[1], eps=1e-5, gemma_norm=norm == "gemma",
        input_stream=(3 * torch.randn(6, 48, generator=generator)).to(device) if stream else None,
        input_eps=1e-5,
    )  # fmt: skip
    scales = {}
    caches = [batch.k_cache, batch.v_cache]
    if cache_dtype is not None:
        scales = dict(
            k_scale=torch.tensor(0.05, device=device), v_scale=torch.tensor(0.04, device=device)
        )
        caches = [torch.nan_to_num(c).div(0.05).to(cache_dtype) for c in caches]
    ref_caches = [c.clone() for c in caches]
    q = qkv_prep_ref(
        qkv, heads, kv_heads, head_dim, positions, prep.cos_sin_cache, *ref_caches, slots,
        prep.q_norm, prep.k_norm, prep.eps, prep.gemma_norm, 1.0, **scales,
        input_stream=prep.input_stream, input_eps=prep.input_eps,
    )  # fmt: skip
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125, window)
    expected = paged_attention_ref(q, *ref_caches, *args, **scales)
    actual = paged_attention(qkv, *caches, *args, num_kv_splits=num_kv_splits, prep=prep, **scales)
    assert actual.shape == (6, heads, head_dim)
    valid = torch.arange(6, device=device) != 3
    if cache_dtype is not None:  # the interpreter rounds to e4m3 unlike torch (see below):
        # hold the kernel to what it stored, and its stores to the reference's, apart
        expected = paged_attention_ref(q, *caches, *args, **scales)
    assert_close(actual[valid], expected[valid], "attention")
    for cache, ref_cache in zip(caches, ref_caches, strict=True):
        if cache_dtype is None:
            assert_close(torch.nan_to_num(cache), torch.nan_to_num(ref_cache), "cache")
        else:  # e4m3 codes: the interpreter's conversion may miss a step at a tie
            close = torch.isclose(cache.float(), ref_cache.float(), rtol=0.07, atol=2**-9)
            assert close.float().mean() > 0.99


def test_default_tiles_follow_the_sweep_only_where_they_fit():
    hopper = 227 * 1024
    assert choose_tiles(True, 4, 128, 2, hopper) == AttentionTiles(16, 128, 4, 2)
    # over an FP8 cache a tile is half the bytes: one more stage in flight
    assert choose_tiles(True, 4, 128, 2, hopper, 1) == AttentionTiles(16, 128, 4, 3)
    assert choose_tiles(True, 4, 128, 2, hopper, 2) == AttentionTiles(16, 128, 4, 2)
    assert choose_tiles(False, 4, 128, 2, hopper, 1) == AttentionTiles(64, 32, 4, 2)
    # steps with prefill rows keep 64x32: 128x64 cost mixed steps (choose_tiles' docstring)
    assert choose_tiles(False, 4, 128, 2, hopper) == AttentionTiles(64, 32, 4, 2)
    # fp32 queries, a 256-wide head, MI300's 64 KiB LDS: the first sweep's tiles
    assert choose_tiles(False, 4, 128, 4, hopper) == AttentionTiles(64, 32, 4, 2)
    assert choose_tiles(True, 2, 256, 2, hopper) == AttentionTiles(16, 32, 8, 2)
    assert choose_tiles(True, 4, 128, 2, 64 * 1024) == AttentionTiles(16, 64, 4, 2)
    # a group wider than the tile widens the rows
    assert choose_tiles(True, 32, 128, 2, hopper).block_m == 32


def test_refuses_a_query_tile_narrower_than_the_group(device, generator):
    batch = make_paged_batch([3], [5], 8, 1, 64, 16, torch.float32, device, generator)
    with pytest.raises(ValueError, match="block_m 4: a power of two >= the group 8"):
        _attend(batch, paged_attention, 0.125, None, tiles=AttentionTiles(4, 16, 4, 1))


@pytest.mark.parametrize("num_kv_splits", [2, 8])
@pytest.mark.parametrize("window", [None, 20])
def test_split_kv_matches_reference_on_decodes(num_kv_splits, window, device, generator):
    # 8 splits over 4 keys leave empty splits; 300 keys leave uneven ones
    batch = make_paged_batch(
        [1, 1, 1], [299, 3, 77], 4, 2, 80, 16, torch.float32, device, generator
    )
    expected = _attend(batch, paged_attention_ref, 0.1, window)
    actual = _attend(batch, paged_attention, 0.1, window, num_kv_splits=num_kv_splits)
    assert_close(actual, expected, f"{num_kv_splits} splits")


def test_split_kv_also_handles_prefill_chunks(device, generator):
    batch = make_paged_batch([1, 19, 2], [50, 30, 0], 4, 2, 64, 8, torch.float16, device, generator)
    expected = _attend(batch, paged_attention_ref, 0.125, None)
    actual = _attend(batch, paged_attention, 0.125, None, num_kv_splits=4)
    assert_close(actual, expected, "split prefill")


def test_int64_metadata_and_padding_rows_left_untouched(device, generator):
    batch = make_paged_batch(
        [3, 1], [4, 20], 2, 1, 32, 16, torch.float32, device, generator, index_dtype=torch.int64
    )
    expected = _attend(batch, paged_attention_ref, 0.2, None)
    num_padding = 3
    for num_kv_splits in (1, 2):
        q = torch.cat([batch.q, batch.q[:num_padding]])  # rows past query_start_loc[-1]
        out = torch.full_like(q, 7.0)
        paged_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            0.2,
            num_kv_splits=num_kv_splits,
            out=out,
        )
        assert_close(out[: len(batch.q)], expected, f"{num_kv_splits} splits")
        assert torch.equal(out[len(batch.q) :], torch.full_like(out[len(batch.q) :], 7.0))


def test_after_reshape_and_cache_matches_torch_attention_module(device, generator):
    """Drop-in check against vtllm.worker.attention: write the step's K/V, then attend."""
    q_lens, context_lens, block_size = [4, 1, 9], [0, 13, 5], 8
    batch = make_paged_batch(
        q_lens, context_lens, 4, 2, 48, block_size, torch.float32, device, generator
    )
    # the torch module reads whole blocks and masks afterwards, so NaN in a block's
    # unused tail would leak into its output (SDPA: 0 * NaN); give it zeros there
    k_cache, v_cache = batch.k_cache.nan_to_num(0.0), batch.v_cache.nan_to_num(0.0)
    reshape_and_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    tables = [
        row[: -(-s // block_size)].tolist()
        for row, s in zip(batch.block_tables, batch.seq_lens_list, strict=True)
    ]
    metadata = torch_attention.build_attention_metadata(
        q_lens, batch.seq_lens_list, tables, block_size, device
    )
    assert torch.equal(metadata.slot_mapping, batch.slot_mapping)
    expected = torch_attention.paged_attention_ref(batch.q, k_cache, v_cache, metadata, 0.3)
    actual = paged_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        0.3,
    )
    assert_close(actual, expected, "vs vtllm.worker.attention")


def test_rejects_what_it_cannot_compute(device, generator):
    batch = make_paged_batch([1], [3], 3, 2, 16, 8, torch.float32, device, generator)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        _attend(batch, paged_attention, 1.0, None)
    batch = make_paged_batch([1], [3], 2, 2, 16, 8, torch.float32, device, generator)
    with pytest.raises(ValueError, match="power of two"):
        _attend(batch, paged_attention, 1.0, None, num_kv_splits=3)


def test_split_heuristic():
    # prefill in the batch, or no host-side max_seq_len: never split
    assert choose_num_kv_splits(10, 3, 8, 32768) == 1
    assert choose_num_kv_splits(3, 3, 8, None) == 1
    # a full GPU of decodes, or short contexts: no split
    assert choose_num_kv_splits(64, 64, 8, 32768) == 1
    assert choose_num_kv_splits(2, 2, 8, 200) == 1
    # few long decodes: enough splits to reach the target, capped by keys per split
    # (at least 128: the H100 sweep's best at 1,024 keys and batch 1 was 8 splits)
    assert choose_num_kv_splits(2, 2, 8, 32768) == 16
    assert choose_num_kv_splits(1, 1, 1, 32768) == 32
    assert choose_num_kv_splits(1, 1, 8, 1024) == 8
    assert choose_num_kv_splits(8, 8, 8, 1024) == 4
    assert choose_num_kv_splits(1, 1, 4, 600) == 4


# ---- GPU: realistic shapes -------------------------------------------------------------

GPU_MODELS = {
    # name: (num_heads, num_kv_heads, head_dim, window)
    "llama3-8b": (32, 8, 128, None),
    "qwen2.5-7b": (28, 4, 128, None),
    "gemma3-local": (8, 4, 256, 1024),
    "phi-like": (32, 32, 80, None),
    "head96": (16, 4, 96, 333),
}


@gpu
@pytest.mark.parametrize("model", sorted(GPU_MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_mixed_long_context(model, dtype, block_size, device):
    num_heads, num_kv_heads, head_dim, window = GPU_MODELS[model]
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 6000, (24,), generator=generator).tolist()
    q_lens = [700, 1, 1, 37, 1, 1200, *([1] * 18)]
    context_lens = [0, 5000, 1, 3000, 8191, 800, *lengths[:18]]
    batch = make_paged_batch(
        q_lens,
        context_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        device,
        generator,
        num_spare_blocks=64,
    )
    scale = head_dim**-0.5
    expected = _attend(batch, paged_attention_ref, scale, window)
    actual = _attend(batch, paged_attention, scale, window, max_seq_len=batch.max_seq_len)
    assert_close(actual, expected, model)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 4096])
def test_gpu_split_kv_vs_single_pass(dtype, window, device):
    generator = torch.Generator().manual_seed(2)
    context_lens = [32767, 16000, 20001, 1]
    batch = make_paged_batch([1] * 4, context_lens, 32, 8, 128, 16, dtype, device, generator)
    assert choose_num_kv_splits(4, 4, 8, batch.max_seq_len) > 1
    expected = _attend(batch, paged_attention_ref, 0.088, window)
    single = _attend(batch, paged_attention, 0.088, window, num_kv_splits=1)
    for num_kv_splits in (None, 4, 16, 32):
        split = _attend(
            batch,
            paged_attention,
            0.088,
            window,
            max_seq_len=batch.max_seq_len,
            num_kv_splits=num_kv_splits,
        )
        assert_close(split, expected, f"{num_kv_splits} splits vs reference")
        assert_close(split, single, f"{num_kv_splits} splits vs single pass")
    assert_close(single, expected, "single pass")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 4), (32, 8)])
def test_gpu_decode_prefetch_matches_the_default_chain(
    dtype, window, num_heads, num_kv_heads, device
):
    """``decode_prefetch`` (the shorter chain of loads, off by default) on the batch-1
    rows' head layouts (Qwen3-0.6B, -30B-A3B, Llama-3-8B): the reference's output and the
    default kernel's, single pass and split (on CPU the two are bit-equal: see
    test_decode_only_batches_take_one_program_a_sequence)."""
    generator = torch.Generator().manual_seed(3)
    context_lens = [159, 0, 1023, 4000, 31, 700, 128, 127]
    batch = make_paged_batch(
        [1] * 8, context_lens, num_heads, num_kv_heads, 128, 16, dtype, device, generator
    )
    expected = _attend(batch, paged_attention_ref, 0.088, window)
    for num_kv_splits in (1, 8):
        default, prefetched = (
            _attend(
                batch,
                paged_attention,
                0.088,
                window,
                num_kv_splits=num_kv_splits,
                decode_prefetch=prefetch,
            )  # fmt: skip
            for prefetch in (False, True)
        )
        assert_close(prefetched, expected, f"{num_kv_splits} splits vs reference")
        assert_close(prefetched, default, f"{num_kv_splits} splits vs the default chain")


@gpu
@pytest.mark.parametrize("cache_dtype", [None, "fp8"])
@pytest.mark.parametrize("num_kv_splits", [1, 8])
def test_gpu_fused_prep_matches_the_prep_kernel_then_attention(cache_dtype, num_kv_splits, device):
    """Qwen3-30B-A3B heads (32 q / 4 kv of 128, q/k norm) in bf16, with the MoE chain's
    input norm: ``prep=`` against ``qkv_prep`` then the attention kernel on the same step.
    The stored k/v are the same bits (the same ``prep_heads`` arithmetic, the same e4m3
    quantisation); the outputs agree to bf16 rounding (the new key's product is summed
    in another order)."""
    from vtllm.worker.kernels.qkv_prep import qkv_prep
    from vtllm.worker.platform import platform_of

    generator = torch.Generator().manual_seed(5)
    context_lens = [159, 0, 1023, 4000, 31, 700, 128, 127]
    batch = make_paged_batch(
        [1] * 8, context_lens, 32, 4, 128, 16, torch.bfloat16, device, generator
    )
    qkv = torch.randn(8, 40 * 128, generator=generator).to(device, torch.bfloat16)
    table = cos_sin_table(128, 8192, {"rope_theta": 1e6, "rope_type": "default"}).to(device)
    weights = [(1 + 0.1 * torch.randn(128, generator=generator)).to(device, torch.bfloat16)]
    weights.append((1 + 0.1 * torch.randn(128, generator=generator)).to(device, torch.bfloat16))
    stream = (3 * torch.randn(8, 2048, generator=generator)).to(device, torch.bfloat16)
    prep = DecodePrep(
        32, (batch.seq_lens - 1).long(), table, batch.slot_mapping, q_norm=weights[0],
        k_norm=weights[1], eps=1e-6, input_stream=stream, input_eps=1e-6,
    )  # fmt: skip
    caches, scales = [torch.nan_to_num(batch.k_cache), torch.nan_to_num(batch.v_cache)], {}
    if cache_dtype == "fp8":
        fp8 = platform_of(device).fp8_dtype
        scales = dict(
            k_scale=torch.tensor(0.02, device=device), v_scale=torch.tensor(0.02, device=device)
        )
        caches = [c.float().div(0.02).to(fp8) for c in caches]
    unfused_caches = [c.clone() for c in caches]
    q = qkv_prep(
        qkv, 32, 4, 128, prep.positions, table, *unfused_caches, batch.slot_mapping,
        weights[0], weights[1], input_stream=stream, **scales,
    )  # fmt: skip
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.088, None)
    expected = paged_attention(q, *unfused_caches, *args, num_kv_splits=num_kv_splits, **scales)
    actual = paged_attention(qkv, *caches, *args, num_kv_splits=num_kv_splits, prep=prep, **scales)
    for cache, unfused in zip(caches, unfused_caches, strict=True):
        assert torch.equal(cache.view(torch.uint8), unfused.view(torch.uint8))
    assert_close(actual, expected, f"fused prep, {num_kv_splits} splits")


def _fp8_batch(q_lens, context_lens, heads, kv_heads, head_dim, device, generator):
    """A paged batch with bf16 queries over e4m3 caches (scales 0.05 / 0.04), and the
    fp32 reference's output on the same numbers."""
    batch = make_paged_batch(
        q_lens, context_lens, heads, kv_heads, head_dim, 16, torch.float32, device, generator
    )
    fp8 = torch.float8_e4m3fn
    caches = [torch.nan_to_num(batch.k_cache).div(0.05), torch.nan_to_num(batch.v_cache).div(0.04)]
    caches = [c.clamp(-448, 448).to(fp8) for c in caches]
    scales = dict(
        k_scale=torch.tensor(0.05, device=device), v_scale=torch.tensor(0.04, device=device)
    )
    q = batch.q.to(torch.bfloat16)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables, head_dim**-0.5, None)
    expected = paged_attention_ref(q.float(), *caches, *args, **scales)
    return q, caches, args, scales, expected


@pytest.mark.parametrize(
    ("q_lens", "context_lens", "num_kv_splits"),
    [(MIXED_Q_LENS, MIXED_CONTEXT_LENS, 1), ([1, 1, 1], [299, 3, 77], 4)],
)
def test_fp8_cache_with_bf16_queries_attends_in_fp16(
    q_lens, context_lens, num_kv_splits, device, generator
):
    """bf16 queries over an FP8 cache take fp16 dots (``FP8_FP16_OPERANDS``: the cache's
    e4m3 and the queries both exact in fp16): a mixed step and split-KV decodes match
    the fp32 reference of the dequantised cache at bf16's tolerance."""
    q, caches, args, scales, expected = _fp8_batch(
        q_lens, context_lens, 8, 2, 64, device, generator
    )
    actual = paged_attention(q, *caches, *args, num_kv_splits=num_kv_splits, **scales)
    assert actual.dtype == torch.bfloat16
    assert_close(actual, expected, f"fp16 dots, {num_kv_splits} splits")


@gpu
@pytest.mark.parametrize("decode_only", [False, True])
def test_gpu_fp8_cache_fp16_dots_are_no_less_accurate_than_bf16_dots(decode_only, device):
    """Llama-3-8B heads (32 / 8 of 128): the FP8 cache's fp16 dots (default) and its bf16
    dots both match the fp32 reference at bf16's tolerance, the fp16 ones at least as
    closely (fp16 keeps 3 more mantissa bits of the same exact inputs)."""
    generator = torch.Generator().manual_seed(11)
    q_lens = [1] * 8 if decode_only else MIXED_Q_LENS
    context_lens = [159, 0, 1023, 4000, 31, 700, 128, 127] if decode_only else MIXED_CONTEXT_LENS
    q, caches, args, scales, expected = _fp8_batch(
        q_lens, context_lens, 32, 8, 128, device, generator
    )
    errors = {}
    for fp16 in (True, False):
        actual = paged_attention(
            q, *caches, *args, max_seq_len=4001, fp8_fp16_operands=fp16, **scales
        )
        assert_close(actual, expected, f"fp8_fp16_operands={fp16}")
        errors[fp16] = (actual.float() - expected.float()).abs().mean().item()
    assert errors[True] <= errors[False] * 1.05, errors
