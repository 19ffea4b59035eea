"""The small-batch GEMV (``vtllm/worker/kernels/gemv.py``) against the library GEMM, per
weight shape, at one row (and ``--rows``), inside device graphs as decode steps run them.

For each shape of the ``--shapes`` models' dense layers: ``F.linear`` (cuBLAS /
hipBLASLt), then every GEMV launch configuration of the grid (``--sweep``) or only
``CANDIDATE_TILES`` (what start-up tries). Weights are cycled over 16 copies so L2 does
not hold them; the timing is ``Platform.graph_us`` (what ``layers/small_batch.py`` uses).
One JSON line per (shape, configuration): microseconds and the bytes' rate.

    python3 benchmarks/gemv_kernel.py --shapes qwen3-0.6b llama3-8b [--sweep] [--fp8]

``--fp8`` quantises each weight to e4m3 with one scale per row (``--quantization fp8``)
and times the FP8 layer's own one-row path (``fp8_matmul``, the Triton kernel) instead of
``F.linear``, against the GEMV reading the FP8 weight with its row scales.

``--pdl`` (CUDA, sm90+) times the fused decode chain's dense part instead
(``LlamaDecoderLayer.forward_fused``: q/k/v with the norm, o with the residual, gate/up
with the norm, down with SwiGLU and the residual) over 16 layers of each dense shape in one
graph, launched plainly and with programmatic dependent launch (each GEMV fetches its first
weight tile while the one before finishes): µs a layer both ways, one JSON line a shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtllm.bench import MODEL_SHAPES  # noqa: E402
from vtllm.worker.kernels.fp8_matmul import fp8_matmul  # noqa: E402
from vtllm.worker.kernels.gemv import CANDIDATE_TILES, GemvTiles, gemv  # noqa: E402
from vtllm.worker.layers.fp8 import quantize_rows  # noqa: E402
from vtllm.worker.platform import detect_platform  # noqa: E402

_COPIES = 16
_CALLS = 32
_REPLAYS = 5


def dense_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a model shape's dense projections and LM head (MoE experts excluded)."""
    hf = MODEL_SHAPES[shape]
    hidden = hf["hidden_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "lm_head": (hf["vocab_size"], hidden),
    }
    if not hf.get("num_experts"):
        width = hf["intermediate_size"]
        shapes["gate_up"] = (2 * width, hidden)
        shapes["down"] = (hidden, width)
    return shapes


def sweep_tiles() -> list[GemvTiles]:
    grid = itertools.product([2, 4, 8, 16, 32], [256, 512, 1024, 2048, 4096], [2, 4, 8])
    tiles = [GemvTiles(n, k, w) for n, k, w in grid if n * k <= 16384]
    return list(dict.fromkeys([*CANDIDATE_TILES, *tiles]))


def time_chain_with_pdl(platform, model: str, tiles: GemvTiles) -> dict:
    """µs a layer of the fused chain's four GEMVs, plain and with PDL (module docstring)."""
    shapes = dense_shapes(model)
    hidden = shapes["o"][0]
    device, dtype = platform.device, torch.bfloat16

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=dtype) / k**0.5

    layers = [
        {name: weight(*shapes[name]) for name in ("qkv", "o", "gate_up", "down")}
        | {
            "norm1": torch.rand(hidden, device=device, dtype=dtype) + 0.5,
            "norm2": torch.rand(hidden, device=device, dtype=dtype) + 0.5,
        }  # fmt: skip
        for _ in range(_COPIES)
    ]
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    o_in = torch.randn(1, shapes["o"][1], device=device, dtype=dtype)

    def layer_chain(i: int, pdl: bool) -> None:
        w = layers[i % _COPIES]
        gemv(x, w["qkv"], tiles, norm_weight=w["norm1"], pdl=pdl)
        h = gemv(o_in, w["o"], tiles, residual=x, pdl=pdl)
        gate_up = gemv(h, w["gate_up"], tiles, norm_weight=w["norm2"], pdl=pdl)
        gemv(gate_up, w["down"], tiles, silu_and_mul=True, residual=h, pdl=pdl)

    plain = platform.graph_us(lambda i: layer_chain(i, False), _CALLS, _REPLAYS)
    with_pdl = platform.graph_us(lambda i: layer_chain(i, True), _CALLS, _REPLAYS)
    layer_bytes = sum(w.numel() * w.element_size() for w in layers[0].values())
    return {"model": model, "tiles": str(tiles), "layer_mb": round(layer_bytes / 1e6, 1),
            "plain_us_a_layer": round(plain, 2), "pdl_us_a_layer": round(with_pdl, 2),
            "pdl_speedup": round(plain / with_pdl, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama3-8b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--sweep", action="store_true", help="the whole grid of tiles")
    parser.add_argument("--fp8", action="store_true", help="e4m3 weights, per-row scales")
    parser.add_argument("--pdl", action="store_true", help="the fused chain, plain vs PDL")
    args = parser.parse_args()
    platform = detect_platform(0)
    if args.pdl:
        for model in args.shapes:
            for tiles in CANDIDATE_TILES[:2]:
                print(json.dumps(time_chain_with_pdl(platform, model, tiles)), flush=True)
        return
    configs = sweep_tiles() if args.sweep else list(CANDIDATE_TILES)
    for model in args.shapes:
        for name, (n, k) in dense_shapes(model).items():
            weights = [
                torch.randn(n, k, device=platform.device, dtype=torch.bfloat16) / k**0.5
                for _ in range(_COPIES)
            ]
            scales = [None] * _COPIES
            if args.fp8:  # (e4m3 weight, per-row scale) pairs
                pairs = [quantize_rows(w, platform.fp8_dtype) for w in weights]
                weights, scales = [w for w, _ in pairs], [s.contiguous() for _, s in pairs]
            element_bytes = weights[0].element_size()
            for rows in args.rows:
                x = torch.randn(rows, k, device=platform.device, dtype=torch.bfloat16)
                common = {"model": model, "layer": name, "n": n, "k": k, "rows": rows,
                          "fp8": args.fp8}  # fmt: skip

                def timed(product, x=x, weights=weights, scales=scales):
                    return platform.graph_us(
                        lambda i: product(x, weights[i % _COPIES], scales[i % _COPIES]),
                        _CALLS,
                        _REPLAYS,
                    )

                if args.fp8:
                    library = timed(lambda x, w, s, k=k: fp8_matmul(x, w, s[:, None], (1, k)))
                else:
                    library = timed(lambda x, w, s: F.linear(x, w))
                results = []
                for tiles in configs:
                    try:
                        us = timed(lambda x, w, s, t=tiles: gemv(x, w, t, row_scale=s))
                    except Exception as e:  # noqa: BLE001 - report, go on
                        print(json.dumps({**common, "tiles": str(tiles), "error": str(e)[:120]}))
                        continue
                    results.append((us, tiles))
                results.sort(key=lambda r: r[0])
                best_us, best = results[0]
                print(
                    json.dumps(
                        {
                            **common,
                            "library_us": round(library, 2),
                            "library_tb_s": round(n * k * element_bytes / library / 1e6, 2),
                            "best_us": round(best_us, 2),
                            "best_tb_s": round(n * k * element_bytes / best_us / 1e6, 2),
                            "best": str(best),
                            "top5": [(round(us, 2), str(t)) for us, t in results[:5]],
                            "candidates_best_us": round(
                                min(us for us, t in results if t in CANDIDATE_TILES), 2
                            ),
                        }
                    ),
                    flush=True,
                )
            weights.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
