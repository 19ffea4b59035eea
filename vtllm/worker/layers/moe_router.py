"""Whether a MoE layer routes a decode step with the fused router kernel, and with which
launch tiles (``kernels/moe_routing.py``: ``moe_router_route``, ``moe_norm_router_route``).

Decided once per (device, dtype, router shape, ``RouterSpec``, norm folded or not) on the
first eager call with a decode step's few tokens (decode-graph warm-up runs eagerly
before each capture), with the layer's own router weight:

1. each candidate tile set must route random hidden states as the router GEMM + the
   routing kernel do (the same experts' scores, the same weights; with the norm folded,
   the same residual sum and normed rows as the RMSNorm kernel);
2. the candidates and the unfused kernels (RMSNorm, router GEMM, routing) are timed in
   device graphs; the fastest candidate is used where it takes under ``TIMED_WIN`` of the
   unfused time.

One log line per decision, with the times. Inside a graph capture that no eager call
preceded (none in the engine), the unfused kernels run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.kernels.moe_routing import RouterTiles
from vtllm.worker.platform import TIMED_WIN

if TYPE_CHECKING:
    from vtllm.worker.layers.moe import RouterSpec

logger = logging.getLogger(__name__)

CANDIDATE_TILES = (  # the first is what session 31 measured (8.3 µs on an H100)
    RouterTiles(block_n=2, block_k=1024, num_warps=4),
    RouterTiles(block_n=2, block_k=1024, num_warps=4, packed_topk=True),
    RouterTiles(block_n=2, block_k=1024, num_warps=1, packed_topk=True),
    RouterTiles(block_n=4, block_k=1024, num_warps=2, packed_topk=True),
    RouterTiles(block_n=2, block_k=1024, num_warps=4, rank_topk=True),
    RouterTiles(block_n=4, block_k=1024, num_warps=2, rank_topk=True),
    # the whole hidden row of a 2,048-wide model in one step: one load a pass, not two
    RouterTiles(block_n=2, block_k=2048, num_warps=4, packed_topk=True),
    RouterTiles(block_n=2, block_k=2048, num_warps=4, rank_topk=True),
)
_CHOSEN: dict[tuple, RouterTiles | None] = {}


def fused_router_tiles(
    x: torch.Tensor,  # [num_tokens, hidden]
    router_weight: torch.Tensor,  # [num_experts, hidden]
    spec: RouterSpec,
    norm: nn.Module | None,  # the RMSNorm folded in (weight, eps), or None
) -> RouterTiles | None:
    """The tiles to run the fused router with for this layer shape, or None for the
    unfused kernels: off a GPU, past ``MAX_FUSED_ROUTER_TOKENS`` tokens or
    ``MAX_KERNEL_EXPERTS`` experts, a router not in x's dtype, or where the start-up
    decision (module docstring) went against it. Decided and logged on the first call."""
    from vtllm.worker.kernels import moe_routing
    from vtllm.worker.platform import platform_of

    if not (
        x.is_cuda
        and x.shape[0] <= moe_routing.MAX_FUSED_ROUTER_TOKENS
        and x.dtype == router_weight.dtype
        and router_weight.shape[0] <= moe_routing.MAX_KERNEL_EXPERTS
    ):
        return None
    key = (x.device, x.dtype, tuple(router_weight.shape), spec, norm is not None)
    if key in _CHOSEN:
        return _CHOSEN[key]
    platform = platform_of(x.device)
    if platform.is_capturing():
        return None
    what = f"fused MoE router ({x.dtype}, router {tuple(router_weight.shape)}" + (
        ", RMSNorm folded)" if norm is not None else ")"
    )
    passing = passing_candidates(x, router_weight, spec, norm, what)
    if not passing:
        logger.warning("%s: disagreed with the router GEMM + routing kernel; not used", what)
        _CHOSEN[key] = None
        return None
    unfused_us = platform.graph_us(_timed(x, router_weight, spec, norm, None))
    timed = {t: platform.graph_us(_timed(x, router_weight, spec, norm, t)) for t in passing}
    best = min(timed, key=timed.__getitem__)
    chosen = best if timed[best] < TIMED_WIN * unfused_us else None
    _CHOSEN[key] = chosen
    logger.info(
        "%s, one token, device graphs: unfused %.1f µs, fused %s → %s",
        what, unfused_us,
        ", ".join(f"{_name(t)} {us:.1f} µs" for t, us in timed.items()),
        f"fused ({_name(best)})" if chosen else "unfused",
    )  # fmt: skip
    return chosen


def passing_candidates(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    spec: RouterSpec,
    norm: nn.Module | None,
    what: str,
) -> list[RouterTiles]:
    """The ``CANDIDATE_TILES`` that route as the unfused kernels do. A candidate that
    fails to build or run (a compiler's refusal on this device) is logged and left out:
    start-up goes on with the others, or with the unfused kernels."""
    passing = []
    for tiles in CANDIDATE_TILES:
        try:
            if routes_like_unfused(x, router_weight, spec, norm, tiles):
                passing.append(tiles)
        except Exception as error:  # noqa: BLE001 - one candidate's failure is not fatal
            logger.warning(
                "%s: candidate %s failed (%s: %s); left out",
                what, _name(tiles), type(error).__name__, str(error)[:200],
            )  # fmt: skip
    return passing


def _name(tiles: RouterTiles) -> str:
    topk = ", rank top-k" if tiles.rank_topk else ", packed top-k" if tiles.packed_topk else ""
    return f"{tiles.block_n}x{tiles.block_k}/{tiles.num_warps}w{topk}"


def _timed(x, router_weight, spec, norm, tiles):
    """``fn(i)`` for ``Platform.graph_us``: one token through the unfused kernels (tiles
    None) or the fused one."""
    from vtllm.worker.kernels import moe_routing
    from vtllm.worker.kernels.rms_norm import rms_norm

    h = torch.randn(1, router_weight.shape[1], device=x.device).to(x.dtype)
    residual = torch.randn_like(h)
    args = (spec.top_k, spec.scoring, spec.renormalize, spec.round_weights)

    def fn(i: int):
        if tiles is None:
            normed = h if norm is None else rms_norm(h, norm.weight, norm.eps, residual)[0]
            return moe_routing.moe_route(F.linear(normed, router_weight), *args)
        if norm is None:
            return moe_routing.moe_router_route(h, router_weight, *args, tiles=tiles)
        return moe_routing.moe_norm_router_route(
            h, residual, norm.weight, norm.eps, router_weight, *args, tiles=tiles
        )

    return fn


def routes_like_unfused(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    spec: RouterSpec,
    norm: nn.Module | None,
    tiles: RouterTiles,
) -> bool:
    """Whether the fused router with ``tiles`` routes random hidden states of x's dtype
    (1 and ``MAX_FUSED_ROUTER_TOKENS`` tokens, four draws each) as the router GEMM +
    ``moe_route`` do: the same experts' scores (one-ulp logits may reorder near-ties),
    the same weights, and with ``norm`` the RMSNorm kernel's residual sum and normed rows."""
    from vtllm.worker.kernels import moe_routing
    from vtllm.worker.kernels.rms_norm import rms_norm

    generator = torch.Generator(device=x.device).manual_seed(0)
    hidden = router_weight.shape[1]
    args = (spec.top_k, spec.scoring, spec.renormalize, spec.round_weights)
    for num_tokens in (1, moe_routing.MAX_FUSED_ROUTER_TOKENS) * 4:
        h = torch.randn(num_tokens, hidden, generator=generator, device=x.device).to(x.dtype)
        if norm is None:
            weights, ids = moe_routing.moe_router_route(h, router_weight, *args, tiles=tiles)
            normed = h
        else:
            residual = torch.randn(h.shape, generator=generator, device=x.device).to(x.dtype)
            weights, ids, fused_normed, fused_sum = moe_routing.moe_norm_router_route(
                h, residual, norm.weight, norm.eps, router_weight, *args, tiles=tiles
            )
            normed, residual_sum = rms_norm(h, norm.weight, norm.eps, residual)
            if not torch.equal(fused_sum, residual_sum) or not torch.allclose(
                fused_normed.float(), normed.float(), atol=0.05, rtol=0.02
            ):
                return False
        logits = F.linear(normed, router_weight)
        ref_weights, ref_ids = moe_routing.moe_route(logits, *args)
        scores = logits.float()
        scores = scores.softmax(-1) if spec.scoring == "softmax" else scores.sigmoid()
        same_scores = torch.allclose(
            scores.gather(1, ids.long()), scores.gather(1, ref_ids.long()), atol=5e-3, rtol=0
        )
        if not same_scores or not torch.allclose(
            weights.float(), ref_weights.float(), atol=2e-2, rtol=0.05
        ):
            return False
    return True
