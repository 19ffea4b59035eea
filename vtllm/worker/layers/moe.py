"""Mixture-of-experts layers: top-k routing and tensor-parallel experts.

* ``select_experts`` turns router logits into each token's top-k expert ids and weights, as
  the model family does it (``RouterSpec``);
* ``FusedMoE`` holds every expert's gate/up/down and runs them through the fused Triton
  kernel on a GPU, its plain-torch reference elsewhere. Tensor parallelism splits each
  expert's intermediate dimension: rank r holds rows ``[r*I/tp, (r+1)*I/tp)`` of every
  expert's gate and up (column-parallel) and the same columns of its down (row-parallel),
  so the experts' outputs are partial sums and one all-reduce per layer completes them::

      w13_weight [E, 2*I/tp, H]   rows: [ gate slice of rank r | up slice of rank r ]
      w2_weight  [E, H, I/tp]     columns: the same slice of down

* ``SparseMoeBlock`` is router + experts, the MLP of Qwen3-MoE and Mixtral layers.

Checkpoints store one tensor per expert and projection (``...experts.{e}.gate_proj.weight``);
``expert_checkpoint_name`` maps such a name onto ``w13_weight`` / ``w2_weight`` with the shard
id ``(e, "gate" | "up" | "down")``, and each parameter lists its expected shard ids in
``shard_ids`` for the loader's missing-tensor check.

Gemma 4 (``models/gemma4.py``) routes through its own scaled router and runs
``StackedExperts``, a ``FusedMoE`` whose loader takes the stacked ``experts.gate_up_proj
[E, 2I, H]`` / ``experts.down_proj [E, H, I]`` tensors whole and splits them per expert.

FP8 experts (``layers/fp8.py``): the two parameters become e4m3 and gain
``w13_weight_scale`` / ``w2_weight_scale`` (per row) or ``..._weight_scale_inv`` (per block)
in the same expert-major layout, filled per (expert, kind) from the checkpoint's
``experts.{e}.{proj}.weight_scale[_inv]``; ``expert_scales`` hands them to the kernel.
Where the GPU dots e4m3 by e4m3 (``Platform.has_fp8_dot``, unless
``VT_MOE_FP8_ACTIVATIONS=off``) the grouped GEMMs quantise their inputs too (w8a8).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.distributed import TPGroup, divide

if TYPE_CHECKING:  # the kernel modules import triton: only when a layer runs
    from vtllm.worker.kernels.fused_moe import ExpertScales
    from vtllm.worker.kernels.moe_routing import RouterTiles

# HF activation name → the fused-MoE kernel's name for it
MOE_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

ExpertShardId = tuple[int, str]  # (expert id, "gate" | "up" | "down")


@dataclass(frozen=True)
class RouterSpec:
    """How a family turns router logits into top-k weights.

    ``scoring``: ``softmax`` over all experts or ``sigmoid`` per expert (in fp32), then the
    top ``top_k`` scores; ``renormalize`` divides them by their sum. ``round_weights``
    rounds the weights to the logits' dtype (Qwen3-MoE does; Mixtral keeps fp32).

    Qwen3-MoE: softmax, renormalize = ``norm_topk_prob``. Mixtral: softmax, renormalize
    (the same as a softmax over the top-k logits).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    round_weights: bool = False


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    spec: RouterSpec,
    expert_scale: torch.Tensor | None = None,  # [num_experts]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)``, both ``[num_tokens, top_k]``; ids in descending score
    order, weights fp32 unless ``spec.round_weights``, times ``expert_scale[ids]`` when
    given. One Triton kernel on a GPU (``kernels/moe_routing.py``), its torch twin
    elsewhere."""
    from vtllm.worker.kernels import moe_routing

    route = moe_routing.moe_route if router_logits.is_cuda else moe_routing.moe_route_ref
    return route(
        router_logits, spec.top_k, spec.scoring, spec.renormalize, spec.round_weights,
        expert_scale,
    )  # fmt: skip


def route_tokens(
    x: torch.Tensor,  # [num_tokens, hidden]
    router: Router,
    spec: RouterSpec,
    expert_scale: torch.Tensor | None = None,  # [num_experts]
    *,
    single_rank: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts(router(x), spec, expert_scale)``; on a GPU with one rank, a decode
    step's few tokens (up to ``MAX_FUSED_ROUTER_TOKENS``) take the router linear and the
    routing in one kernel (``moe_router_route``) where ``layers/moe_router.py`` found it
    correct and faster for this shape; other steps the router GEMM and the routing
    kernel. Several ranks always take the latter: each rank routes for itself, and a
    choice timed per rank could differ, and with it a near-tie's expert."""
    from vtllm.worker.kernels import moe_routing
    from vtllm.worker.layers.moe_router import fused_router_tiles

    tiles = fused_router_tiles(x, router.weight, spec, None) if single_rank else None
    if tiles is not None:
        return moe_routing.moe_router_route(
            x, router.weight, spec.top_k, spec.scoring, spec.renormalize, spec.round_weights,
            expert_scale, tiles,
        )  # fmt: skip
    return select_experts(router(x), spec, expert_scale)


@functools.cache
def fp8_dot_on(device: torch.device) -> bool:
    """Whether FP8 experts on ``device`` run their grouped GEMMs as w8a8 (module docstring)."""
    from vtllm import envs
    from vtllm.worker.platform import platform_of

    return envs.VT_MOE_FP8_ACTIVATIONS != "off" and platform_of(device).has_fp8_dot


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs, each token's output the weighted sum of its top-k; each
    expert's intermediate dim split over the TP ranks (module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise NotImplementedError(
                f"expert activation {activation!r} is not supported "
                f"(supported: {', '.join(MOE_ACTIVATIONS)})"
            )
        self.tp = tp
        self.num_experts = num_experts
        self.activation = MOE_ACTIVATIONS[activation]
        self.local_size = divide(intermediate_size, tp.size, "moe intermediate size")
        self.w13_weight = _empty_param(num_experts, 2 * self.local_size, hidden_size)
        self.w2_weight = _empty_param(num_experts, hidden_size, self.local_size)
        self.w13_weight.shard_ids = [(e, s) for e in range(num_experts) for s in ("gate", "up")]
        self.w2_weight.shard_ids = [(e, "down") for e in range(num_experts)]
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        # (w13, w2) scales when the weights are FP8 (set by layers/fp8.py), else None
        self.expert_scales: tuple[ExpertScales, ExpertScales] | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShardId
    ) -> None:
        """Copy this rank's slice of one expert's full gate / up ``[I, H]`` or down
        ``[H, I]`` checkpoint tensor; ValueError on a wrong shape or expert id."""
        expert, kind = shard_id
        size, rank = self.local_size, self.tp.rank
        full = size * self.tp.size
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts}")
        hidden = self.w2_weight.shape[1]
        expected = (hidden, full) if kind == "down" else (full, hidden)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert} {kind}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {expected}"
            )
        if kind == "down":
            param.data[expert].copy_(loaded.narrow(1, rank * size, size))
        else:
            offset = 0 if kind == "gate" else size
            param.data[expert].narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k]
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
    ) -> torch.Tensor:
        from vtllm.worker.kernels import fused_moe as kernels

        w13_scales, w2_scales = self.expert_scales or (None, None)
        args = (x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)
        if not x.is_cuda:
            out = kernels.fused_moe_ref(*args, w13_scales=w13_scales, w2_scales=w2_scales)
        else:
            fp8_activations = self.expert_scales is not None and fp8_dot_on(x.device)
            out = kernels.fused_moe(
                *args, w13_scales=w13_scales, w2_scales=w2_scales, fp8_activations=fp8_activations
            )
        return self.tp.all_reduce(out)  # [num_tokens, hidden]

    def forward_into_stream(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], on a GPU, num_tokens * top_k <= num_experts
        topk_weights: torch.Tensor,  # [num_tokens, top_k]
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
        residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream
        next_norm_weight: torch.Tensor | None,  # [hidden]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One rank's decode path with the residual add in its last kernel:
        ``kernels/fused_moe.py``'s ``fused_moe_into_stream``."""
        from vtllm.worker.kernels import fused_moe as kernels

        w13_scales, w2_scales = self.expert_scales or (None, None)
        return kernels.fused_moe_into_stream(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, residual,
            next_norm_weight, self.activation, w13_scales, w2_scales,
        )  # fmt: skip


class Router(nn.Module):
    """The replicated ``[num_experts, hidden]`` gate projection (no bias)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = _empty_param(num_experts, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [num_tokens, num_experts]


class SparseMoeBlock(nn.Module):
    """``gate`` (router) + ``experts``: Qwen3-MoE's ``mlp`` and Mixtral's
    ``block_sparse_moe`` (no shared expert)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        router: RouterSpec,
        tp: TPGroup,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.router = router
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        single_rank = self.experts.tp.size == 1
        topk_weights, topk_ids = route_tokens(x, self.gate, self.router, single_rank=single_rank)
        return self.experts(x, topk_weights, topk_ids)

    def fold_norm_tiles(self, x: torch.Tensor, norm: nn.Module) -> RouterTiles | None:
        """The tiles ``forward_after_norm`` runs with for these hidden states, or None
        where it should not run: several ranks (``route_tokens``), a Gemma-rounded norm,
        or where ``layers/moe_router.py`` does not run the fused router (its
        ``fused_router_tiles``)."""
        from vtllm.worker.layers.moe_router import fused_router_tiles

        if self.experts.tp.size != 1 or getattr(norm, "gemma", True):
            return None
        return fused_router_tiles(x, self.gate.weight, self.router, norm)

    def forward_after_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: attention's output
        residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream
        norm: nn.Module,  # the RMSNorm before this block (weight, eps)
        tiles: RouterTiles,  # from fold_norm_tiles
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(x, residual))`` and the new residual stream, the norm folded
        into the router's kernel (``moe_norm_router_route``): one launch fewer. Call when
        ``fold_norm_tiles`` gave tiles."""
        topk_weights, topk_ids, h, residual = self._norm_and_route(x, residual, norm, tiles)
        return self.experts(h, topk_weights, topk_ids), residual  # [num_tokens, hidden]

    def forward_into_stream(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: attention's output
        residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream
        norm: nn.Module,  # the RMSNorm before this block
        tiles: RouterTiles,  # from fold_norm_tiles
        next_norm_weight: torch.Tensor | None,  # [hidden]: the next layer's RMSNorm weight
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_after_norm`` with the block's output added to the stream in the
        experts' last kernel: ``(stream after the block, stream * next_norm_weight)``
        (``FusedMoE.forward_into_stream``), for the decode chain of
        ``models/moe_llama.py``. Call on one rank with ``fold_norm_tiles``' tiles and at
        most ``num_experts / top_k`` tokens."""
        topk_weights, topk_ids, h, residual = self._norm_and_route(x, residual, norm, tiles)
        return self.experts.forward_into_stream(
            h, topk_weights, topk_ids, residual, next_norm_weight
        )

    def _norm_and_route(self, x, residual, norm, tiles) -> tuple[torch.Tensor, ...]:
        """``(topk_weights, topk_ids, normed x + residual, x + residual)`` from the fused
        router kernel (``moe_norm_router_route``)."""
        from vtllm.worker.kernels import moe_routing

        spec = self.router
        return moe_routing.moe_norm_router_route(
            x, residual, norm.weight, norm.eps, self.gate.weight, spec.top_k, spec.scoring,
            spec.renormalize, spec.round_weights, tiles,
        )  # fmt: skip


_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)"
    r"\.(?P<suffix>weight|weight_scale|weight_scale_inv)$"
)


def expert_checkpoint_name(
    name: str, projections: dict[str, str]
) -> tuple[str, ExpertShardId] | None:
    """``(parameter name, (expert, kind))`` for a per-expert checkpoint tensor such as
    ``model.layers.3.mlp.experts.17.gate_proj.weight``, or None for any other name; an FP8
    checkpoint's ``...gate_proj.weight_scale[_inv]`` maps onto ``w13_weight_scale[_inv]``.
    ``projections`` maps the checkpoint's projection names to ``gate`` / ``up`` / ``down``
    (Qwen3-MoE: ``gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral: ``w1`` / ``w3`` / ``w2``).
    """
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in projections:
        return None
    kind = projections[match["proj"]]
    param = ("w2_" if kind == "down" else "w13_") + match["suffix"]
    return f"{match['prefix']}.{param}", (int(match["expert"]), kind)
