"""FP8 weight kernels against their dequantising references: ``fp8_matmul`` (dense, per-row
and block scales) and ``fused_moe`` with FP8 experts (GEMM and GEMV paths, per-row and block
scales); the references against a hand-written dequantisation; on a GPU also
``torch._scaled_mm`` (the per-row dense path, activations quantised per token) against the
reference, and the Qwen3-30B-A3B MoE layer in FP8.

Tolerances: the kernels dequantise exactly (e4m3 fits in every activation dtype), so the
kernel-vs-reference tolerance is the activation dtype's (``marks.TOLERANCES``).
``_scaled_mm`` quantises the activations too: per-token e4m3 rounding (relative 2^-4 per
element) averages out over K, bounded here at 5 % of the output's scale.
"""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.fp8_matmul import Tiles, dequantize_ref, fp8_matmul, fp8_matmul_ref
from vtllm.worker.kernels.fused_moe import ExpertScales, fused_moe, fused_moe_ref

from .marks import assert_close, gpu

FP8 = torch.float8_e4m3fn


def _fp8_problem(n, k, block, generator):
    """Random FP8 weight [n, k] with positive scales of the given block grid."""
    w = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(FP8)
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=generator) * 1e-3 + 1e-4
    return w, scale


def _fp8_device_dtype(device) -> torch.dtype:
    from vtllm.worker.platform import platform_of

    return platform_of(torch.device(device)).fp8_dtype


def test_dequantize_ref_matches_hand_written_blocks():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, -5.0, 6.0], [0.5, 0.25, -8.0]]).to(FP8)
    scale = torch.tensor([[2.0, 10.0], [3.0, 100.0]])  # blocks (2, 2) over a 3x3 weight
    expected = torch.tensor(
        [[2.0, 4.0, 30.0], [8.0, -10.0, 60.0], [1.5, 0.75, -800.0]], dtype=torch.float32
    )
    assert torch.equal(dequantize_ref(w, scale, (2, 2), torch.float32), expected)
    per_row = torch.tensor([[2.0], [3.0], [4.0]])
    assert torch.equal(dequantize_ref(w, per_row, (1, 3), torch.float32), w.float() * per_row)


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "dtype"),
    [
        (3, 40, 64, (16, 32), torch.float32),  # ragged N edge block
        (1, 96, 80, (32, 16), torch.float32),  # decode row, bn != bk, ragged K
        (20, 24, 48, (1, 48), torch.float32),  # per-row scales, two M tiles
        (2, 24, 200, (1, 200), torch.float32),  # per-row, two K tiles
        (5, 64, 128, (128, 128), torch.float16),  # one partial 128x128 block
    ],
)
def test_fp8_matmul_matches_reference(m, n, k, block, dtype, device, generator):
    w, scale = _fp8_problem(n, k, block, generator)
    x = torch.randn(m, k, generator=generator)
    x, w, scale = x.to(device, dtype), w.to(device), scale.to(device)
    actual = fp8_matmul(x, w, scale, block)
    assert actual.shape == (m, n) and actual.dtype == dtype
    assert_close(actual, fp8_matmul_ref(x, w, scale, block), f"{block}")


def test_fp8_matmul_tiles_override(device, generator):
    """A launch configuration other than the default (wider K tiles, 8 warps) computes the
    same product; a K tile that does not divide the scale block is refused."""
    w, scale = _fp8_problem(48, 300, (1, 300), generator)
    x = torch.randn(2, 300, generator=generator)
    x, w, scale = x.to(device), w.to(device), scale.to(device)
    actual = fp8_matmul(x, w, scale, (1, 300), Tiles(16, 32, 256, num_warps=8))
    assert_close(actual, fp8_matmul_ref(x, w, scale, (1, 300)), "tiles")
    w_blk, s_blk = _fp8_problem(32, 128, (32, 32), generator)
    with pytest.raises(ValueError, match="BLOCK_K 64 does not divide"):
        fp8_matmul(x[:, :128], w_blk.to(device), s_blk.to(device), (32, 32), Tiles(16, 16, 64))


def test_fp8_matmul_refuses_bad_scales(device):
    w = torch.zeros(32, 64, dtype=FP8, device=device)
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match=r"scale \(1, 1\) \(expected \(2, 2\)"):
        fp8_matmul(x, w, torch.ones(1, 1, device=device), (16, 32))
    with pytest.raises(ValueError, match="power-of-two block_k >= 16"):
        fp8_matmul(x, w, torch.ones(4, 8, device=device), (8, 8))


def _moe_problem(num_tokens, hidden, inter, num_experts, top_k, block, dtype, device, gen):
    """FP8 experts with per-row (block None) or block scales, routing as in test_fused_moe."""
    x = torch.randn(num_tokens, hidden, generator=gen)
    # e4m3fn has no infinity: values past 448 would become NaN
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 100).clamp(-448, 448)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 100).clamp(-448, 448)
    w13, w2 = w13.to(FP8), w2.to(FP8)
    if block is None:
        s13 = torch.rand(num_experts, 2 * inter, generator=gen) * 1e-3 / hidden**0.5
        s2 = torch.rand(num_experts, hidden, generator=gen) * 1e-2 / inter**0.5
    else:
        bn, bk = block
        grid13 = (num_experts, -(-2 * inter // bn), -(-hidden // bk))
        grid2 = (num_experts, -(-hidden // bn), -(-inter // bk))
        s13 = torch.rand(grid13, generator=gen) * 1e-3 / hidden**0.5
        s2 = torch.rand(grid2, generator=gen) * 1e-2 / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k)
    scales = (ExpertScales(s13.to(device), block), ExpertScales(s2.to(device), block))
    tensors = (x.to(device, dtype), w13.to(device), w2.to(device))
    return (*tensors, topk_weights.to(device), topk_ids.to(device)), scales


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    ("path", "shape", "block"),
    [
        # (num_tokens, hidden, inter, num_experts, top_k)
        ("gemm", (19, 64, 32, 6, 2), (16, 32)),
        ("gemm", (9, 48, 32, 5, 3), None),
        ("gemv", (3, 64, 48, 8, 2), (16, 16)),
        ("gemv", (2, 40, 24, 5, 1), None),
    ],
)
def test_fused_moe_fp8_experts_match_reference(path, shape, block, device, generator):
    problem, (s13, s2) = _moe_problem(*shape, block, torch.float32, device, generator)
    actual = fused_moe(*problem, "silu", path, w13_scales=s13, w2_scales=s2)
    expected = fused_moe_ref(*problem, "silu", w13_scales=s13, w2_scales=s2)
    assert_close(actual, expected, f"{path} {block}")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    ("shape", "block"),
    [((19, 64, 32, 6, 2), (16, 32)), ((9, 48, 32, 5, 3), None), ((70, 256, 128, 3, 2), (128, 128))],
)
def test_fused_moe_w8a8_matches_reference(shape, block, device, generator):
    """The grouped GEMMs with e4m3 inputs too (``fp8_activations``): the reference that
    quantises the same rows the same way, within the activation dtype's tolerance; and
    the weights-only reference within what rounding two inputs to e4m3 costs: 3 mantissa
    bits are ~2.5-3.6 % RMS relative error an input, and a dot product keeps that ratio
    (measured 3.2-4.4 % here), so under 6 % RMS of the output."""
    problem, (s13, s2) = _moe_problem(*shape, block, torch.float32, device, generator)
    scales = dict(w13_scales=s13, w2_scales=s2)
    actual = fused_moe(*problem, "silu", "gemm", **scales, fp8_activations=True)
    expected = fused_moe_ref(*problem, "silu", **scales, fp8_activations=True)
    assert_close(actual, expected, f"w8a8 {block}")
    weights_only = fused_moe_ref(*problem, "silu", **scales)
    error = float((actual - weights_only).norm() / weights_only.norm())
    assert 0 < error < 0.06, error
    # plain (not FP8) experts ignore the flag
    x, _, _, topk_weights, topk_ids = problem
    w13, w2 = s13.dequantize(problem[1], 0), s2.dequantize(problem[2], 0)
    plain = (x, w13.expand(shape[3], -1, -1), w2.expand(shape[3], -1, -1), topk_weights, topk_ids)
    torch.testing.assert_close(
        fused_moe(*plain, "silu", "gemm", fp8_activations=True),
        fused_moe(*plain, "silu", "gemm"),
        atol=0,
        rtol=0,
    )


def test_fused_moe_ref_fp8_equals_dequantised_weights(generator):
    """The FP8 reference is the plain reference over the dequantised experts."""
    problem, (s13, s2) = _moe_problem(4, 64, 32, 4, 2, (16, 32), torch.float32, "cpu", generator)
    x, w13, w2, topk_weights, topk_ids = problem
    w13_deq = torch.stack([s13.dequantize(w13, e) for e in range(4)])
    w2_deq = torch.stack([s2.dequantize(w2, e) for e in range(4)])
    assert torch.equal(w13_deq[1], dequantize_ref(w13[1], s13.scale[1], (16, 32), torch.float32))
    torch.testing.assert_close(
        fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scales=s13, w2_scales=s2),
        fused_moe_ref(x, w13_deq, w2_deq, topk_weights, topk_ids),
        atol=0,
        rtol=0,
    )


@gpu
@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_gpu_fp8_matmul_bf16(m, block, device):
    """A Qwen3-30B-A3B qkv projection shape (hidden 2048 → 5120) in bf16."""
    gen = torch.Generator().manual_seed(1)
    n, k = 5120, 2048
    w, scale = _fp8_problem(n, k, block or (1, k), gen)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w, scale = w.to(device), scale.to(device)
    actual = fp8_matmul(x, w, scale, block or (1, k))
    # the fp32 reference: the kernel's only rounding is its bf16 output
    expected = fp8_matmul_ref(x.float(), w, scale, block or (1, k))
    assert_close(actual, expected, f"m={m} {block}")


@gpu
@pytest.mark.parametrize("m", [1, 64, 300])
def test_gpu_scaled_mm_path_matches_reference(m, device):
    """The dense per-row path on NVIDIA sm_89+: ``torch._scaled_mm`` with per-token FP8
    activations (64 and 300 tokens; 1 token takes the Triton kernel) against the
    dequantised bf16 reference."""
    from vtllm.worker.layers.fp8 import Fp8LinearMethod, quantize_rows
    from vtllm.worker.platform import platform_of

    if not platform_of(torch.device(device)).has_fp8_scaled_mm:
        pytest.skip("no _scaled_mm with row-wise scales on this GPU")
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(4096, 2048, generator=gen).to(device, torch.bfloat16) * 0.02
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = quantize_rows(weight, torch.float8_e4m3fn)
    x = torch.randn(m, 2048, generator=gen).to(device, torch.bfloat16)
    actual = Fp8LinearMethod(None, "scaled_mm").apply(layer, x)
    expected = Fp8LinearMethod(None, "reference").apply(layer, x)
    error = (actual.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error < 0.05, error


@gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_gpu_qwen3_30b_a3b_layer_fp8(num_tokens, block, device):
    """A Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts, top-8, width 768), FP8 experts."""
    gen = torch.Generator().manual_seed(3)
    problem, (s13, s2) = _moe_problem(
        num_tokens, 2048, 768, 128, 8, block, torch.bfloat16, device, gen
    )
    fp8 = _fp8_device_dtype(device)
    problem = (problem[0], problem[1].to(fp8), problem[2].to(fp8), *problem[3:])
    actual = fused_moe(*problem, "silu", w13_scales=s13, w2_scales=s2)
    expected = fused_moe_ref(*problem, "silu", w13_scales=s13, w2_scales=s2)
    assert_close(actual, expected, f"T={num_tokens} {block}")


@gpu
@pytest.mark.parametrize("num_tokens", [64, 256, 2048])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_gpu_qwen3_30b_a3b_layer_w8a8(num_tokens, block, device):
    """The same layer's grouped GEMMs with e4m3 activations (where the GPU dots fp8):
    the quantising reference within bf16's tolerance, the weights-only one within 6 % RMS."""
    from vtllm.worker.platform import platform_of

    if not platform_of(torch.device(device)).has_fp8_dot:
        pytest.skip("no fp8 x fp8 tl.dot on this GPU")
    gen = torch.Generator().manual_seed(4)
    problem, (s13, s2) = _moe_problem(
        num_tokens, 2048, 768, 128, 8, block, torch.bfloat16, device, gen
    )
    fp8 = _fp8_device_dtype(device)
    problem = (problem[0], problem[1].to(fp8), problem[2].to(fp8), *problem[3:])
    scales = dict(w13_scales=s13, w2_scales=s2)
    actual = fused_moe(*problem, "silu", "gemm", **scales, fp8_activations=True)
    expected = fused_moe_ref(*problem, "silu", **scales, fp8_activations=True)
    assert_close(actual, expected, f"w8a8 T={num_tokens} {block}")
    weights_only = fused_moe_ref(*problem, "silu", **scales).float()
    error = float((actual.float() - weights_only).norm() / weights_only.norm())
    assert error < 0.06, error
