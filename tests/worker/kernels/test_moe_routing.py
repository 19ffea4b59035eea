"""moe_route (one Triton program per token) vs its torch twin: scores, top-k order, ties,
renormalisation, rounding and per-expert scales."""

from __future__ import annotations

import pytest
import torch

from vtllm.worker.kernels.moe_routing import moe_route, moe_route_ref

from .marks import gpu


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "scoring", "renormalize"),
    [
        (1, 128, 8, "softmax", True),  # Qwen3-30B-A3B at decode
        (7, 60, 4, "softmax", False),  # odd expert count, raw softmax scores
        (5, 8, 2, "softmax", True),  # Mixtral
        (3, 257, 1, "sigmoid", False),  # wider than a power of two
        (4, 16, 3, "sigmoid", True),
    ],
)
def test_matches_reference(num_tokens, num_experts, top_k, scoring, renormalize, device, generator):
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(device)
    weights, ids = moe_route(logits, top_k, scoring, renormalize)
    ref_weights, ref_ids = moe_route_ref(logits, top_k, scoring, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.shape == weights.shape == (num_tokens, top_k)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())  # same experts, same order
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(num_tokens))


def test_ties_pick_the_lowest_expert_id(device):
    logits = torch.zeros(2, 6, device=device)
    logits[0, [1, 4]] = 3.0  # two equal leaders
    logits[1, :] = torch.tensor([0.5, 2.0, 2.0, 2.0, -1.0, 0.5])
    _, ids = moe_route(logits, 3, "softmax", True)
    assert ids.tolist() == [[1, 4, 0], [1, 2, 3]]


def test_expert_scale_and_rounding(device, generator):
    logits = torch.randn(6, 32, generator=generator).to(device)
    expert_scale = torch.rand(32, generator=generator).to(device) + 0.5
    weights, ids = moe_route(logits, 4, expert_scale=expert_scale)
    ref_weights, ref_ids = moe_route_ref(logits, 4, expert_scale=expert_scale)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    # Qwen3-MoE rounds the renormalised weights to the logits' dtype (fp16 here: the
    # interpreter truncates bf16 casts)
    half = logits.half()
    rounded, _ = moe_route(half, 4, round_weights=True)
    ref_rounded, _ = moe_route_ref(half, 4, round_weights=True)
    assert rounded.dtype == torch.float16
    torch.testing.assert_close(rounded, ref_rounded, atol=1e-3, rtol=1e-3)


def test_refusals_name_the_numbers(device):
    logits = torch.zeros(2, 4, device=device)
    with pytest.raises(ValueError, match="top_k=5"):
        moe_route(logits, 5)
    with pytest.raises(ValueError, match="tanh"):
        moe_route(logits, 2, "tanh")
    weights, ids = moe_route(logits[:0], 2)  # no tokens: nothing launched
    assert weights.shape == ids.shape == (0, 2)


@gpu
def test_gpu_bf16_router_of_qwen3_30b_a3b(device, generator):
    """bf16 logits of 256 tokens (many exact ties: bf16 keeps 8 bits): the kernel and
    torch pick experts of the same scores in the same order, with the same weights."""
    logits = torch.randn(256, 128, generator=generator).to(device, torch.bfloat16)
    weights, ids = moe_route(logits, 8, "softmax", True, round_weights=True)
    ref_weights, ref_ids = moe_route_ref(logits, 8, "softmax", True, round_weights=True)
    scores = logits.float().softmax(-1)
    assert torch.equal(scores.gather(1, ids.long()), scores.gather(1, ref_ids))
    assert (ids.long() == ref_ids).float().mean() > 0.9  # ties aside, the same ids
    torch.testing.assert_close(weights.float(), ref_weights.float(), atol=4e-3, rtol=1e-2)
