"""Decode batches of 1–4 rows through the GEMV kernel where it beats the library GEMM,
decided by timing both on this device at start-up.

``tune_small_batch_linears`` groups a model's dense bf16/fp16 linears (and the LM head) by
weight shape; for each shape it times, inside device graphs (as decode steps replay them),
one row through ``F.linear`` and through each of ``kernels/gemv.py``'s candidate tiles,
cycling over up to ``_DISTINCT_WEIGHTS`` layers of that shape so that L2 does not hold the
weight; where the best GEMV takes less than ``TIMED_WIN`` of the library's time, every layer of
the shape gets ``GemvMethod`` (products of more rows still take ``F.linear``). One log line
says what was timed and chosen. Only with decode graphs: eagerly, Triton's launch cost
(tens of µs from Python) would eat the gain.

FP8 layers with per-row scales are timed the same way against their own method's one-row
path (the Triton FP8 kernel), and where the GEMV wins their ``Fp8LinearMethod`` gets its
tiles. Other layers that already have a ``linear_method`` (FP8 block scales, CPU int4 /
int8) are left alone.

Then the fused decode chain (Llama-family decoders, ``LlamaDecoderLayer.forward_fused``):
a layer's dense part at one row — norm, q/k/v, o, residual add and norm, gate/up,
activation, down — as the four GEMVs with the norms, the activation and the residual adds
folded in, against the same part as it runs unfused (with whatever the per-shape choice
above installed), both in device graphs over up to ``_DISTINCT_WEIGHTS`` layers. Where
the chain wins, the model takes it for steps of up to ``MAX_GEMV_ROWS`` tokens: three
kernels a layer fewer (on a small model a decode step is mostly such kernels' fixed cost).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.kernels.gemv import CANDIDATE_TILES, MAX_GEMV_ROWS, GemvTiles, gemv
from vtllm.worker.layers.embedding import ParallelLMHead
from vtllm.worker.layers.linear import ColumnParallelLinear, LinearMethod, RowParallelLinear
from vtllm.worker.platform import TIMED_WIN

logger = logging.getLogger(__name__)

_DISTINCT_WEIGHTS = 16  # weights cycled through per timing (past an H200's 50 MB L2)
_CALLS_PER_GRAPH = 32
_REPLAYS = 5


@dataclass(frozen=True)
class FusedDecodeTiles:
    """The GEMV tiles of each projection in ``LlamaDecoderLayer.forward_fused``."""

    qkv: GemvTiles
    o: GemvTiles
    gate_up: GemvTiles
    down: GemvTiles
    max_rows: int = MAX_GEMV_ROWS  # steps of at most this many tokens take the chain
    pdl: bool = False  # launch the GEMVs with programmatic dependent launch (CUDA sm90+)


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
    own_us: float
    gemv_us: float
    tiles: GemvTiles
    scaled: bool = False  # FP8 weights with row scales

    @property
    def gemv_wins(self) -> bool:
        return self.gemv_us < TIMED_WIN * self.own_us

    def describe(self) -> str:
        n, k = self.shape
        t = self.tiles
        verdict = "GEMV" if self.gemv_wins else "own"
        return (
            f"{n}x{k} ×{self.num_layers}: own {self.own_us:.1f} µs, GEMV "
            f"{self.gemv_us:.1f} µs ({t.block_n}x{t.block_k}, {t.num_warps} warps) → {verdict}"
        )


_LINEAR_KINDS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _dense_layers(model: nn.Module) -> dict[tuple[int, int], list[nn.Module]]:
    """Layers the GEMV may serve, by weight shape: plain bf16/fp16 weights on a GPU."""
    by_shape: dict[tuple[int, int], list[nn.Module]] = {}
    for module in model.modules():
        if not isinstance(module, _LINEAR_KINDS) or module.linear_method is not None:
            continue
        weight = module.weight
        if weight.dtype not in (torch.bfloat16, torch.float16) or not weight.is_cuda:
            continue
        by_shape.setdefault(tuple(weight.shape), []).append(module)
    return by_shape


def _fp8_row_scaled_layers(model: nn.Module) -> dict[tuple[int, int], list[nn.Module]]:
    """FP8 layers with per-row scales on a GPU (their ``Fp8LinearMethod`` runs a kernel,
    not the CPU reference), by weight shape."""
    from vtllm.worker.layers.fp8 import Fp8LinearMethod

    by_shape: dict[tuple[int, int], list[nn.Module]] = {}
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if not isinstance(method, Fp8LinearMethod) or method.block is not None:
            continue
        if method.backend == "reference" or not module.weight.is_cuda:
            continue
        by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    return by_shape


def time_shape(platform, layers: list[nn.Module], dtype: torch.dtype | None = None) -> ShapeTiming:
    """Time one row through the layers' own product and each candidate GEMV on
    ``layers``' weights (all of one shape). The own product is ``F.linear`` for plain
    weights, the layer's ``linear_method`` (one row) for FP8 ones, whose GEMV then applies
    the row scales; ``dtype`` is the activations' (default: the weight's)."""
    layers = layers[:_DISTINCT_WEIGHTS]
    scaled = layers[0].linear_method is not None
    n, k = layers[0].weight.shape
    x = torch.randn(1, k, device=layers[0].weight.device, dtype=dtype or layers[0].weight.dtype)

    def graph_us(product) -> float:  # one row through product(x, layer), layers in turn
        return platform.graph_us(
            lambda i: product(x, layers[i % len(layers)]), _CALLS_PER_GRAPH, _REPLAYS
        )

    if scaled:
        own_us = graph_us(lambda x, layer: layer.linear_method.apply(layer, x))
    else:
        own_us = graph_us(lambda x, layer: F.linear(x, layer.weight))

    def with_tiles(tiles):
        def product(x, layer):
            scale = layer.weight_scale if scaled else None
            return gemv(x, layer.weight, tiles, row_scale=scale)

        return product

    gemv_us = {}
    for tiles in CANDIDATE_TILES:
        try:
            gemv_us[tiles] = graph_us(with_tiles(tiles))
        except Exception as error:  # noqa: BLE001 - a tile set this device refuses: left out
            logger.warning(
                "small-batch GEMV %dx%d, tiles %s failed (%s: %s); left out",
                n, k, tiles, type(error).__name__, str(error)[:200],
            )  # fmt: skip
            gemv_us[tiles] = math.inf  # never below TIMED_WIN × own: the own product stays
    tiles = min(gemv_us, key=gemv_us.get)
    return ShapeTiming((n, k), len(layers), own_us, gemv_us[tiles], tiles, scaled)


def tune_small_batch_linears(
    model: nn.Module, platform, dtype: torch.dtype = torch.bfloat16
) -> list[ShapeTiming]:
    """Time every dense weight shape of ``model`` and install ``GemvMethod`` (or, on FP8
    per-row layers, the GEMV's tiles in their ``Fp8LinearMethod``) where the GEMV wins
    (module docstring); returns the timings. ``dtype``: the activations' of FP8 layers.
    Compiles the chosen kernels for every row count up to ``MAX_GEMV_ROWS`` before any
    graph is captured."""
    started = time.monotonic()
    timings = []
    groups = [(layers, False) for layers in _dense_layers(model).values()]
    groups += [(layers, True) for layers in _fp8_row_scaled_layers(model).values()]
    for layers, fp8 in groups:
        timing = time_shape(platform, layers, dtype if fp8 else None)
        timings.append(timing)
        if not timing.gemv_wins:
            continue
        for layer in layers:
            if fp8:
                layer.linear_method.gemv_tiles = timing.tiles
            else:
                layer.linear_method = GemvMethod(timing.tiles)
        layer = layers[0]
        for rows in range(1, MAX_GEMV_ROWS + 1):  # one compile per power-of-two row block
            x = torch.zeros(rows, layer.weight.shape[1], device=layer.weight.device,
                            dtype=dtype if fp8 else layer.weight.dtype)  # fmt: skip
            layer.linear_method.apply(layer, x)
    platform.synchronize()
    if timings:
        logger.info(
            "small-batch linears (1 row, device graphs), %d shapes timed in %.1fs: %s",
            len(timings),
            time.monotonic() - started,
            "; ".join(t.describe() for t in timings),
        )
        runnable = {t.shape: t.tiles for t in timings if not t.scaled and math.isfinite(t.gemv_us)}
        tune_fused_decode(model, platform, runnable)
    return timings


def _fused_decode_layers(model: nn.Module) -> tuple[list[nn.Module], str | None]:
    """The decoder layers the fused chain would run, or why it cannot."""
    if not hasattr(model, "fused_decode"):
        return [], f"{type(model).__name__} has no fused decode chain"
    layers = list(model.model.layers)
    for layer in layers:
        why_not = layer.fused_decode_eligible()
        if why_not:
            return [], why_not
    return layers, None


def time_decode_chain(
    platform, layers: list[nn.Module], tiles: FusedDecodeTiles
) -> tuple[float, float]:
    """µs per layer of one row through the dense part of ``layers`` (attention left out:
    the same in both), ``(unfused, fused)``."""
    layers = layers[:_DISTINCT_WEIGHTS]
    attn = layers[0].self_attn
    weight = attn.qkv_proj.weight
    x = torch.randn(1, weight.shape[1], device=weight.device, dtype=weight.dtype)
    o = torch.randn(1, attn.o_proj.weight.shape[1], device=weight.device, dtype=weight.dtype)

    def unfused(i: int) -> None:
        layer = layers[i % len(layers)]
        h, residual = layer.input_layernorm(x, x)
        layer.self_attn.qkv_proj(h)
        layer.post_attention(o, residual)

    def fused(i: int, tiles: FusedDecodeTiles = tiles) -> None:
        layer = layers[i % len(layers)]
        layer.fused_qkv(x, tiles)
        layer.fused_post_attention(o, x, tiles)

    return (
        platform.graph_us(unfused, _CALLS_PER_GRAPH, _REPLAYS),
        platform.graph_us(fused, _CALLS_PER_GRAPH, _REPLAYS),
    )


def _pdl_available(platform) -> bool:
    """Programmatic dependent launch: CUDA on sm90 or later, with VT_DECODE_PDL=auto (off
    by default: the chain's timing alone picked it on an H100 where the served decode step
    then ran 16 % slower, docs/BENCHMARKS.md session 42)."""
    from vtllm import envs

    return envs.VT_DECODE_PDL == "auto" and platform.has_programmatic_dependent_launch


def time_chain_with_pdl(
    platform, layers: list[nn.Module], tiles: FusedDecodeTiles
) -> tuple[float | None, str]:
    """µs per layer of the fused chain's dense part launched with PDL, after a check that
    it gives the plain chain's bits (eagerly, two rows); ``(None, why)`` where it cannot
    be used."""
    layer = layers[0]
    weight = layer.self_attn.qkv_proj.weight
    x = torch.randn(2, weight.shape[1], device=weight.device, dtype=weight.dtype)
    o = torch.randn(2, layer.self_attn.o_proj.weight.shape[1], device=x.device, dtype=x.dtype)
    with_pdl = dataclasses.replace(tiles, pdl=True)
    try:
        plain = (layer.fused_qkv(x, tiles), layer.fused_post_attention(o, x, tiles))
        launched = (layer.fused_qkv(x, with_pdl), layer.fused_post_attention(o, x, with_pdl))
        platform.synchronize()
        if not all(torch.equal(a, b) for a, b in zip(plain, launched, strict=True)):
            return None, "its outputs differ from the plain launch's"
        return time_decode_chain(platform, layers, with_pdl)[1], ""
    except Exception as error:  # noqa: BLE001 - e.g. a Triton without launch_pdl, a graph
        return None, f"{type(error).__name__}: {error}"[:200]


def tune_fused_decode(
    model: nn.Module, platform, tiles_by_shape: dict[tuple[int, int], GemvTiles]
) -> FusedDecodeTiles | None:
    """Time the fused decode chain against the unfused layer (module docstring) with each
    projection's best GEMV tiles from ``tiles_by_shape``; set ``model.fused_decode`` where
    it wins and return it (None, and a log line saying why, where not)."""
    layers, why_not = _fused_decode_layers(model)
    if not layers:
        if hasattr(model, "fused_decode"):
            logger.info("fused decode chain: not for this model (%s)", why_not)
        return None
    attn, mlp = layers[0].self_attn, layers[0].mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    shapes = [tuple(linear.weight.shape) for linear in projections]
    if any(shape not in tiles_by_shape for shape in shapes):
        return None
    tiles = FusedDecodeTiles(*(tiles_by_shape[shape] for shape in shapes))
    try:
        unfused_us, plain_us = time_decode_chain(platform, layers, tiles)
    except Exception as error:  # noqa: BLE001 - a chain this device refuses: stay unfused
        logger.warning(
            "fused decode chain: timing failed (%s: %s); unfused",
            type(error).__name__, str(error)[:200],
        )  # fmt: skip
        model.fused_decode = None
        return None
    fused_us, pdl = plain_us, ""
    if _pdl_available(platform):
        pdl_us, why_not = time_chain_with_pdl(platform, layers, tiles)
        if pdl_us is not None and pdl_us < TIMED_WIN * fused_us:
            tiles, fused_us = dataclasses.replace(tiles, pdl=True), pdl_us
        pdl = f", with PDL {pdl_us:.1f} µs" if pdl_us is not None else f", no PDL ({why_not})"
    wins = fused_us < TIMED_WIN * unfused_us
    logger.info(
        "fused decode chain (1 row, device graphs): a layer's dense part %.1f µs unfused, "
        "%.1f µs fused%s → %s",
        unfused_us,
        plain_us,
        pdl,
        f"fused{' with PDL' if tiles.pdl else ''} for steps of up to {tiles.max_rows} tokens"
        if wins
        else "unfused",
    )
    model.fused_decode = tiles if wins else None
    return model.fused_decode
