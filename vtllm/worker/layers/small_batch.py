"""Decode batches of 1–4 rows through the GEMV kernel where it beats the library GEMM,
decided by timing both on this device at start-up.

``tune_small_batch_linears`` groups a model's dense bf16/fp16 linears (and the LM head) by
weight shape; for each shape it times, inside device graphs (as decode steps replay them),
one row through ``F.linear`` and through each of ``kernels/gemv.py``'s candidate tiles,
cycling over up to ``_DISTINCT_WEIGHTS`` layers of that shape so that L2 does not hold the
weight; where the best GEMV takes less than ``_WIN`` of the library's time, every layer of
the shape gets ``GemvMethod`` (products of more rows still take ``F.linear``). One log line
says what was timed and chosen. Only with decode graphs: eagerly, Triton's launch cost
(tens of µs from Python) would eat the gain.

Layers that already have a ``linear_method`` (FP8, CPU int4/int8) are left alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.kernels.gemv import CANDIDATE_TILES, MAX_GEMV_ROWS, GemvTiles, gemv
from vtllm.worker.layers.embedding import ParallelLMHead
from vtllm.worker.layers.linear import ColumnParallelLinear, LinearMethod, RowParallelLinear

logger = logging.getLogger(__name__)

_DISTINCT_WEIGHTS = 16  # weights cycled through per timing (past an H200's 50 MB L2)
_CALLS_PER_GRAPH = 32
_REPLAYS = 5
_WIN = 0.95  # the GEMV must take less than this share of the library's time


class GemvMethod(LinearMethod):
    """Up to ``MAX_GEMV_ROWS`` rows through ``gemv`` with ``tiles``; more through F.linear."""

    def __init__(self, tiles: GemvTiles) -> None:
        self.tiles = tiles

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MAX_GEMV_ROWS:
            return gemv(x, layer.weight, self.tiles)
        return F.linear(x, layer.weight)


@dataclass(frozen=True)
class ShapeTiming:
    """One weight shape's start-up timing at one row: µs per product."""

    shape: tuple[int, int]  # (N, K)
    num_layers: int
    library_us: float
    gemv_us: float
    tiles: GemvTiles

    @property
    def gemv_wins(self) -> bool:
        return self.gemv_us < _WIN * self.library_us

    def describe(self) -> str:
        n, k = self.shape
        t = self.tiles
        verdict = "GEMV" if self.gemv_wins else "library"
        return (
            f"{n}x{k} ×{self.num_layers}: library {self.library_us:.1f} µs, GEMV "
            f"{self.gemv_us:.1f} µs ({t.block_n}x{t.block_k}, {t.num_warps} warps) → {verdict}"
        )


def _dense_layers(model: nn.Module) -> dict[tuple[int, int], list[nn.Module]]:
    """Layers the GEMV may serve, by weight shape: plain bf16/fp16 weights on a GPU."""
    by_shape: dict[tuple[int, int], list[nn.Module]] = {}
    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    for module in model.modules():
        if not isinstance(module, kinds) or module.linear_method is not None:
            continue
        weight = module.weight
        if weight.dtype not in (torch.bfloat16, torch.float16) or not weight.is_cuda:
            continue
        by_shape.setdefault(tuple(weight.shape), []).append(module)
    return by_shape


def time_shape(platform, layers: list[nn.Module]) -> ShapeTiming:
    """Time one row through the library GEMM and each candidate GEMV on ``layers``'
    weights (all of one shape)."""
    weights = [layer.weight for layer in layers[:_DISTINCT_WEIGHTS]]
    n, k = weights[0].shape
    x = torch.randn(1, k, device=weights[0].device, dtype=weights[0].dtype)

    def graph_us(product) -> float:  # one row through product(x, weight), weights in turn
        return platform.graph_us(
            lambda i: product(x, weights[i % len(weights)]), _CALLS_PER_GRAPH, _REPLAYS
        )

    library_us = graph_us(F.linear)
    gemv_us = {tiles: graph_us(lambda x, w, t=tiles: gemv(x, w, t)) for tiles in CANDIDATE_TILES}
    tiles = min(gemv_us, key=gemv_us.get)
    return ShapeTiming((n, k), len(layers), library_us, gemv_us[tiles], tiles)


def tune_small_batch_linears(model: nn.Module, platform) -> list[ShapeTiming]:
    """Time every dense weight shape of ``model`` and install ``GemvMethod`` where the
    GEMV wins (module docstring); returns the timings. Compiles the chosen kernels for
    every row count up to ``MAX_GEMV_ROWS`` before any graph is captured."""
    started = time.monotonic()
    timings = []
    for layers in _dense_layers(model).values():
        timing = time_shape(platform, layers)
        timings.append(timing)
        if not timing.gemv_wins:
            continue
        method = GemvMethod(timing.tiles)
        for layer in layers:
            layer.linear_method = method
        weight = layers[0].weight
        for rows in range(1, MAX_GEMV_ROWS + 1):  # one compile per power-of-two row block
            gemv(torch.zeros(rows, weight.shape[1], device=weight.device, dtype=weight.dtype),
                 weight, timing.tiles)  # fmt: skip
    platform.synchronize()
    if timings:
        logger.info(
            "small-batch linears (1 row, device graphs), %d shapes timed in %.1fs: %s",
            len(timings),
            time.monotonic() - started,
            "; ".join(t.describe() for t in timings),
        )
    return timings
