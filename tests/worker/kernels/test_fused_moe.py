"""fused_moe (Triton: grouped GEMM and decode GEMV paths) vs its plain-torch reference, and
the reference vs a per-token dense formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtllm.worker.kernels.fused_moe import fit_shared_memory, fused_moe, fused_moe_ref
from vtllm.worker.kernels.fused_moe_decode import moe_decode_into_stream
from vtllm.worker.kernels.moe_align import align_pairs_by_expert, align_pairs_by_expert_ref
from vtllm.worker.kernels.moe_common import ACTIVATIONS

from .marks import assert_close, gpu


def _problem(num_tokens, hidden, inter, num_experts, top_k, dtype, device, generator):
    """Random x / expert weights / softmax-top-k routing, drawn on CPU then moved."""
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k)
    return (
        x.to(device, dtype),
        w13.to(device, dtype),
        w2.to(device, dtype),
        topk_weights.to(device),
        topk_ids.to(device),
    )


def test_align_pairs_by_expert_exact_layout():
    # pairs 0..5 (token t, slot j -> pair 2t + j) to experts 2 0 | 2 2 | 0 3; 4 experts
    topk_ids = torch.tensor([[2, 0], [2, 2], [0, 3]])
    sorted_pair_ids, block_expert_ids, num_padded = align_pairs_by_expert_ref(topk_ids, 4, 2)
    pad = 6
    # expert 0: pairs 1, 4 | expert 1: none | expert 2: pairs 0, 2, 3 (+pad) | expert 3: 5 (+pad)
    assert sorted_pair_ids.tolist()[:8] == [1, 4, 0, 2, 3, pad, 5, pad]
    assert set(sorted_pair_ids.tolist()[8:]) <= {pad}
    assert num_padded.tolist() == [8]
    assert block_expert_ids.tolist()[:4] == [0, 2, 2, 3]
    # worst-case sizing: cdiv(6, 2) + min(4, 6) blocks
    assert block_expert_ids.numel() == 7 and sorted_pair_ids.numel() == 14


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_m",
    [(3, 2, 4, 2), (1, 8, 128, 16), (37, 8, 128, 16), (300, 8, 128, 64), (50, 2, 8, 16)],
)
def test_align_kernel_matches_reference(device, num_tokens, top_k, num_experts, block_m):
    """The kernels' layout is the reference's up to the order of pairs inside an expert's
    run: the same padding and block experts, the same set of pairs in every block."""
    generator = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, : num_experts // 2] += 2.0  # uneven loads: some experts get many pairs
    topk_ids = torch.topk(logits, top_k).indices.to(device)
    actual = align_pairs_by_expert(topk_ids, num_experts, block_m)
    expected = align_pairs_by_expert_ref(topk_ids, num_experts, block_m)
    assert actual[2].tolist() == expected[2].tolist()
    assert actual[1].tolist() == expected[1].tolist()
    assert actual[0].numel() == expected[0].numel()
    got = actual[0].view(-1, block_m).sort(dim=1).values
    want = expected[0].view(-1, block_m).sort(dim=1).values
    assert got.tolist() == want.tolist()


def test_grouped_tiles_shrink_to_fit_shared_memory():
    h200, mi300 = 232_448, 65_536
    # Triton asked 278,528 bytes of an H200 for this fp32 gate/up configuration
    assert fit_shared_memory((64, 128, 64, 8, 4), 4, True, h200) == (64, 128, 64, 8, 2)
    assert fit_shared_memory((64, 128, 64, 8, 4), 2, True, h200) == (64, 128, 64, 8, 4)
    assert fit_shared_memory((64, 128, 64, 8, 3), 2, False, h200) == (64, 128, 64, 8, 3)
    assert fit_shared_memory((64, 128, 64, 8, 4), 2, True, mi300) == (64, 128, 32, 8, 2)
    assert fit_shared_memory((16, 128, 128, 4, 3), 2, True, mi300) == (16, 128, 32, 4, 2)


def test_reference_matches_per_token_formula(generator):
    x, w13, w2, topk_weights, topk_ids = _problem(5, 24, 10, 4, 2, torch.float32, "cpu", generator)
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(topk_ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += topk_weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(
        fused_moe_ref(x, w13, w2, topk_weights, topk_ids), expected, atol=1e-5, rtol=1e-5
    )


# numpy's exp overflows to inf for very negative gates; sigmoid is then 0, as on a GPU
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    ("path", "activation", "dtype", "shape"),
    [
        # (num_tokens, hidden, inter, num_experts, top_k): odd sizes, unused experts
        ("gemm", "silu", torch.float32, (19, 72, 40, 6, 2)),
        ("gemm", "gelu_tanh", torch.float16, (9, 130, 24, 5, 3)),
        ("gemm", "silu", torch.float32, (150, 40, 24, 2, 1)),  # two 64-row blocks per expert
        ("gemv", "silu", torch.float16, (3, 72, 40, 8, 2)),
        ("gemv", "gelu_tanh", torch.float32, (2, 130, 24, 5, 1)),
        ("auto", "silu", torch.float32, (1, 72, 40, 8, 2)),
    ],
)
def test_matches_reference(path, activation, dtype, shape, device, generator):
    x, w13, w2, topk_weights, topk_ids = _problem(*shape, dtype, device, generator)
    if dtype == torch.float16:  # routing weights in the activation dtype (Qwen3-MoE rounds)
        topk_weights = topk_weights.half()
    actual = fused_moe(x, w13, w2, topk_weights, topk_ids, activation, path)
    assert actual.shape == x.shape and actual.dtype == dtype
    expected = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, activation)
    assert_close(actual, expected, f"{path} {activation}")


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_into_stream_adds_the_residual_and_scales(with_norm, dtype, device, generator):
    """The decode path with the next norm's residual add (and its weight) in the down
    kernel's epilogue: the block's output plus the stream, rounded, and that times the
    weight, rounded, as ``rms_norm`` and its weight round them."""
    x, w13, w2, topk_weights, topk_ids = _problem(3, 72, 40, 8, 2, dtype, device, generator)
    residual = torch.randn(3, 72, generator=generator).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(72, generator=generator)).to(device, dtype)
    pairs = topk_ids.numel()
    stream, scaled = moe_decode_into_stream(
        x, w13, w2, topk_weights.reshape(pairs).contiguous(),
        topk_ids.reshape(pairs).to(torch.int32), ACTIVATIONS["silu"], residual,
        weight if with_norm else None,
    )  # fmt: skip
    block = fused_moe_ref(x, w13, w2, topk_weights, topk_ids).to(dtype)
    expected = (block.float() + residual.float()).to(dtype)
    assert_close(stream, expected, "stream")
    if with_norm:
        assert_close(scaled, (expected.float() * weight.float()).to(dtype), "scaled")
    else:
        assert scaled is None
    with pytest.raises(ValueError, match=r"residual \(3, 71\)"):
        moe_decode_into_stream(
            x, w13, w2, topk_weights.reshape(pairs), topk_ids.reshape(pairs).int(), 0,
            residual[:, :71], None,
        )  # fmt: skip


def test_no_tokens_and_bad_shapes(device):
    w13, w2 = torch.zeros(4, 6, 8, device=device), torch.zeros(4, 8, 3, device=device)
    empty = fused_moe(
        torch.zeros(0, 8, device=device),
        w13,
        w2,
        torch.zeros(0, 2, device=device),
        torch.zeros(0, 2, dtype=torch.long, device=device),
    )
    assert empty.shape == (0, 8)
    with pytest.raises(ValueError, match=r"w2 \(4, 8, 4\)"):
        fused_moe(
            torch.zeros(1, 8, device=device),
            w13,
            torch.zeros(4, 8, 4, device=device),
            torch.ones(1, 2, device=device),
            torch.zeros(1, 2, dtype=torch.long, device=device),
        )


@gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256])
@pytest.mark.parametrize("path", ["auto", "gemm", "gemv"])
def test_gpu_qwen3_30b_a3b_layer_bf16(num_tokens, path, device):
    """A Qwen3-30B-A3B MoE layer: hidden 2048, 128 experts, top-8, expert width 768."""
    problem = _problem(
        num_tokens, 2048, 768, 128, 8, torch.bfloat16, device, torch.Generator().manual_seed(3)
    )
    actual = fused_moe(*problem, "silu", path)
    assert_close(actual, fused_moe_ref(*problem, "silu"), f"{path} T={num_tokens}")
