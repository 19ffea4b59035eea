"""moe_route (one Triton program per token) vs its torch twin: scores, top-k order, ties,
renormalisation, rounding and per-expert scales; moe_router_route (router linear and routing
in one launch, the last program to arrive routing) vs the linear then the twin."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtllm.worker.kernels.moe_routing import (
    MAX_FUSED_ROUTER_TOKENS,
    RouterTiles,
    moe_norm_router_route,
    moe_route,
    moe_route_ref,
    moe_router_route,
)
from vtllm.worker.kernels.rms_norm import rms_norm_ref

from .marks import TOLERANCES, gpu


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


def _router_ref(x, gate_weight, top_k, scoring="softmax", renormalize=True, **kwargs):
    return moe_route_ref(torch.nn.functional.linear(x, gate_weight), top_k, scoring,
                         renormalize, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "hidden", "top_k", "scoring", "renormalize", "tiles"),
    [
        (1, 128, 2048, 8, "softmax", True, None),  # Qwen3-30B-A3B at batch 1
        (1, 128, 2048, 8, "softmax", True, RouterTiles(block_n=4, block_k=256)),
        (3, 60, 96, 4, "softmax", False, None),  # odd experts, hidden not a power of two
        (8, 257, 64, 1, "sigmoid", False, RouterTiles(block_n=8, block_k=64)),
        (5, 8, 200, 2, "softmax", True, RouterTiles(block_n=1)),  # Mixtral, 8 programs
        (1, 128, 2048, 8, "softmax", True, RouterTiles(packed_topk=True)),
        (3, 60, 96, 4, "sigmoid", False, RouterTiles(block_n=4, packed_topk=True)),
        (1, 128, 2048, 8, "softmax", True, RouterTiles(rank_topk=True)),
        (5, 60, 96, 4, "sigmoid", False, RouterTiles(block_n=4, num_warps=2, rank_topk=True)),
        (2, 200, 64, 6, "softmax", True, RouterTiles(block_n=8, rank_topk=True)),  # > 128: packed
    ],
)
def test_fused_router_matches_linear_then_reference(
    num_tokens, num_experts, hidden, top_k, scoring, renormalize, tiles, device, generator
):
    x = torch.randn(num_tokens, hidden, generator=generator).to(device)
    gate = (torch.randn(num_experts, hidden, generator=generator) / hidden**0.5).to(device)
    weights, ids = moe_router_route(x, gate, top_k, scoring, renormalize, tiles=tiles)
    ref_weights, ref_ids = _router_ref(x, gate, top_k, scoring, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.shape == weights.shape == (num_tokens, top_k)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-4)


def test_fused_router_leaves_its_counter_at_zero_for_the_next_launch(device, generator):
    """Each launch's last program resets the arrivals counter: launches in a row (as graph
    replays are) each route their own tokens."""
    from vtllm.worker.kernels._triton import arrival_counters

    gate = torch.randn(32, 64, generator=generator).to(device)
    for _ in range(3):
        x = torch.randn(2, 64, generator=generator).to(device)
        _, ids = moe_router_route(x, gate, 4, tiles=RouterTiles(block_n=4))
        assert torch.equal(ids.long().cpu(), _router_ref(x, gate, 4)[1].cpu())
        assert arrival_counters(torch.device(device), 1).item() == 0


def test_packed_top_k_picks_the_lowest_id_on_ties(device):
    """Equal scores: the one-reduction top-k orders them by id, as the two-reduction one."""
    gate = torch.zeros(6, 4, device=device)
    gate[[1, 4], 0] = 3.0  # experts 1 and 4 lead, equal; then 0, 2, 3, 5 equal
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], device=device)
    for tiles in (RouterTiles(), RouterTiles(packed_topk=True), RouterTiles(rank_topk=True)):
        _, ids = moe_router_route(x, gate, 4, tiles=tiles)
        assert ids.tolist() == [[1, 4, 0, 2]], tiles


@pytest.mark.parametrize("tiles", [None, RouterTiles(rank_topk=True)])
def test_fused_router_expert_scale_and_rounding(tiles, device, generator):
    x = torch.randn(4, 48, generator=generator).to(device)
    gate = torch.randn(16, 48, generator=generator).to(device) / 7
    expert_scale = torch.rand(16, generator=generator).to(device) + 0.5
    weights, ids = moe_router_route(x, gate, 3, expert_scale=expert_scale, tiles=tiles)
    ref_weights, ref_ids = _router_ref(x, gate, 3, expert_scale=expert_scale)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-4)
    # fp16 hidden states: logits and weights rounded to fp16 as the router linear does
    # (fp16, not bf16: the interpreter truncates bf16 casts)
    half_x, half_gate = x.half(), gate.half()
    rounded, rounded_ids = moe_router_route(half_x, half_gate, 3, round_weights=True, tiles=tiles)
    ref_rounded, ref_rounded_ids = _router_ref(
        half_x.float(), half_gate.float(), 3, round_weights=False
    )
    assert rounded.dtype == torch.float16
    torch.testing.assert_close(rounded.float(), ref_rounded, atol=2e-3, rtol=2e-3)


def test_fused_router_refusals_name_the_numbers(device):
    x = torch.zeros(MAX_FUSED_ROUTER_TOKENS + 1, 16, device=device)
    gate = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match=f"up to {MAX_FUSED_ROUTER_TOKENS} tokens, got 9"):
        moe_router_route(x, gate, 2)
    with pytest.raises(ValueError, match=r"\[num_experts, 16\]"):
        moe_router_route(x[:1], gate[:, :8], 2)
    with pytest.raises(ValueError, match="top_k=9"):
        moe_router_route(x[:1], gate, 9)
    weights, ids = moe_router_route(x[:0], gate, 2)  # no tokens: nothing launched
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "dtype", "tiles"),
    [
        (1, 256, torch.float32, None),
        (3, 200, torch.float32, RouterTiles(block_n=4, block_k=64)),  # 4 chunks, a ragged one
        (8, 96, torch.float16, RouterTiles(block_n=2, block_k=512)),
    ],
)
def test_norm_router_matches_rms_norm_then_router(num_tokens, hidden, dtype, tiles, device,
                                                  generator):  # fmt: skip
    """RMSNorm(x + residual) folded in: the normed rows and the residual sum as the
    RMSNorm kernel's twin gives them, the routing of the normed rows."""
    x = torch.randn(num_tokens, hidden, generator=generator).to(device, dtype)
    residual = torch.randn(num_tokens, hidden, generator=generator).to(device, dtype)
    norm_weight = (torch.rand(hidden, generator=generator) + 0.5).to(device, dtype)
    gate = (torch.randn(24, hidden, generator=generator) / hidden**0.5).to(device, dtype)
    weights, ids, normed, residual_sum = moe_norm_router_route(
        x, residual, norm_weight, 1e-6, gate, 4, tiles=tiles
    )
    ref_normed, ref_sum = rms_norm_ref(x, norm_weight, 1e-6, residual)
    assert torch.equal(residual_sum.cpu(), ref_sum.cpu())
    torch.testing.assert_close(normed, ref_normed, **TOLERANCES[dtype])
    ref_weights, ref_ids = _router_ref(normed.float(), gate.float(), 4)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights, ref_weights, atol=2e-3, rtol=2e-3)


def test_norm_router_refuses_mismatched_norm_inputs(device):
    x = torch.zeros(2, 16, device=device)
    gate = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match=r"residual \(2, 8\)"):
        moe_norm_router_route(x, x[:, :8], torch.ones(16, device=device), 1e-6, gate, 2)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 8])
def test_gpu_fused_router_of_qwen3_30b_a3b_under_graph_replays(num_tokens, device, generator):
    """bf16 at the real shape, captured once in a CUDA graph and replayed on new hidden
    states: every replay routes as cuBLAS's linear + moe_route do (ties aside)."""
    gate = (torch.randn(128, 2048, generator=generator) / 45).to(device, torch.bfloat16)
    x = torch.randn(num_tokens, 2048, generator=generator).to(device, torch.bfloat16)
    moe_router_route(x, gate, 8, round_weights=True)  # warm-up: compile, counter
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = moe_router_route(x, gate, 8, round_weights=True)
    for _ in range(20):
        x.copy_(torch.randn(num_tokens, 2048, generator=generator).to(device, torch.bfloat16))
        graph.replay()
        logits = torch.nn.functional.linear(x, gate)
        ref_weights, ref_ids = moe_route(logits, 8, "softmax", True, round_weights=True)
        scores = logits.float().softmax(-1)
        # the same scores picked (a one-ulp logit difference may reorder exact ties)
        torch.testing.assert_close(
            scores.gather(1, ids.long()), scores.gather(1, ref_ids.long()), atol=2e-3, rtol=0
        )
        torch.testing.assert_close(weights.float(), ref_weights.float(), atol=8e-3, rtol=2e-2)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_gpu_norm_router_of_qwen3_30b_a3b(num_tokens, device, generator):
    """bf16, the real shape: the residual sum bit for bit, the normed rows within one
    bf16 step of the RMSNorm kernel's, and the same experts for the same scores."""
    from vtllm.worker.kernels.rms_norm import rms_norm

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, torch.bfloat16)

    x, residual = draw(num_tokens, 2048), draw(num_tokens, 2048, scale=4.0)
    norm_weight, gate = draw(2048, scale=0.1) + 1, draw(128, 2048, scale=1 / 45)
    weights, ids, normed, residual_sum = moe_norm_router_route(
        x, residual, norm_weight, 1e-6, gate, 8, round_weights=True
    )
    ref_normed, ref_sum = rms_norm(x, norm_weight, 1e-6, residual)
    assert torch.equal(residual_sum, ref_sum)
    torch.testing.assert_close(normed, ref_normed, atol=2e-2, rtol=1e-2)
    logits = torch.nn.functional.linear(normed, gate)
    ref_weights, ref_ids = moe_route(logits, 8, "softmax", True, round_weights=True)
    scores = logits.float().softmax(-1)
    torch.testing.assert_close(
        scores.gather(1, ids.long()), scores.gather(1, ref_ids.long()), atol=2e-3, rtol=0
    )


@pytest.mark.parametrize("fold_norm", [False, True])
def test_start_up_check_passes_the_kernel_and_catches_a_wrong_one(
    fold_norm, device, generator, monkeypatch
):
    """The layer's once-per-shape check (``layers/moe_router.py``) accepts the fused
    kernel at every candidate tile set, and refuses one that routes to the wrong experts."""
    from vtllm.worker.kernels import moe_routing
    from vtllm.worker.layers.moe import RouterSpec
    from vtllm.worker.layers.moe_router import CANDIDATE_TILES, routes_like_unfused
    from vtllm.worker.layers.norm import RMSNorm

    gate = (torch.randn(16, 64, generator=generator) / 8).to(device)
    x = torch.zeros(1, 64, device=device)
    norm = None
    if fold_norm:
        norm = RMSNorm(64, 1e-6).to(device)
        norm.weight.data = (torch.rand(64, generator=generator) + 0.5).to(device)
    spec = RouterSpec(top_k=4)
    for tiles in CANDIDATE_TILES:
        assert routes_like_unfused(x, gate, spec, norm, tiles)
    # a 2,048-wide row, where the 2,048-K candidates take the whole row in one step
    wide_gate = (torch.randn(16, 2048, generator=generator) / 45).to(device)
    wide_x = torch.randn(1, 2048, generator=generator).to(device)
    wide_norm = None
    if fold_norm:
        wide_norm = RMSNorm(2048, 1e-6).to(device)
        wide_norm.weight.data = (torch.rand(2048, generator=generator) + 0.5).to(device)
    for tiles in [t for t in CANDIDATE_TILES if t.block_k >= 2048]:
        assert routes_like_unfused(wide_x, wide_gate, spec, wide_norm, tiles)

    def shifted(fn):
        def wrong(*args, **kwargs):
            weights, ids, *rest = fn(*args, **kwargs)
            return (weights, (ids + 1) % 16, *rest)

        return wrong

    monkeypatch.setattr(moe_routing, "moe_router_route", shifted(moe_routing.moe_router_route))
    monkeypatch.setattr(
        moe_routing, "moe_norm_router_route", shifted(moe_routing.moe_norm_router_route)
    )
    assert not routes_like_unfused(x, gate, spec, norm, CANDIDATE_TILES[0])


def test_a_candidate_that_fails_to_build_is_left_out_not_fatal(device, monkeypatch, caplog):
    """Start-up's candidate check survives a tile set the compiler refuses: that one is
    logged and left out, the others still pass."""
    import logging

    from vtllm.worker.kernels import moe_routing
    from vtllm.worker.layers import moe_router
    from vtllm.worker.layers.moe import RouterSpec

    real = moe_routing.moe_router_route

    def refuses_rank_top_k(*args, tiles=None, **kwargs):
        if tiles is not None and tiles.rank_topk:
            raise RuntimeError("out of resources: shared memory")
        return real(*args, tiles=tiles, **kwargs)

    monkeypatch.setattr(moe_routing, "moe_router_route", refuses_rank_top_k)
    gate = torch.randn(16, 64, device=device) / 8
    x = torch.zeros(1, 64, device=device)
    with caplog.at_level(logging.WARNING, logger="vtllm.worker.layers.moe_router"):
        passing = moe_router.passing_candidates(x, gate, RouterSpec(top_k=4), None, "router")
    assert passing == [t for t in moe_router.CANDIDATE_TILES if not t.rank_topk]
    refusals = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    num_rank = sum(t.rank_topk for t in moe_router.CANDIDATE_TILES)
    assert len(refusals) == num_rank and "out of resources" in refusals[0]


@gpu
def test_gpu_start_up_picks_by_time_and_logs_it(device, caplog):
    """On a GPU the choice is made once per layer shape, timed against the unfused
    kernels, and logged with both times."""
    import logging

    from vtllm.worker.layers import moe_router
    from vtllm.worker.layers.moe import RouterSpec

    gate = (torch.randn(128, 2048, device=device) / 45).bfloat16()
    x = torch.zeros(1, 2048, device=device, dtype=torch.bfloat16)
    spec = RouterSpec(top_k=8, round_weights=True)
    moe_router._CHOSEN.clear()
    with caplog.at_level(logging.INFO, logger="vtllm.worker.layers.moe_router"):
        chosen = moe_router.fused_router_tiles(x, gate, spec, None)
        assert moe_router.fused_router_tiles(x, gate, spec, None) == chosen  # cached
    lines = [r.getMessage() for r in caplog.records if "fused MoE router" in r.getMessage()]
    assert len(lines) == 1 and "unfused" in lines[0] and "µs" in lines[0]
    assert chosen is None or chosen in moe_router.CANDIDATE_TILES


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(
        st.lists(st.sampled_from([-1.0, 0.0, 0.5, 2.0]), min_size=12, max_size=12),
        min_size=1, max_size=MAX_FUSED_ROUTER_TOKENS,
    ),
    top_k=st.integers(1, 12),
    packed=st.booleans(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
)  # fmt: skip
def test_fused_top_k_orders_ties_by_id(rows, top_k, packed, scoring, device):
    """Logits from four values (ties everywhere; the identity as the router): both top-k
    variants pick the experts a stable descending sort of the scores does, in its order."""
    logits = torch.tensor(rows, device=device)  # [num_tokens, 12]
    identity = torch.eye(12, device=device)
    _, ids = moe_router_route(
        logits, identity, top_k, scoring, False, tiles=RouterTiles(block_n=4, packed_topk=packed)
    )
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert ids.long().cpu().tolist() == expected.cpu().tolist()
