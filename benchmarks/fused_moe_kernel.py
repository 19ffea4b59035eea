"""The fused-MoE kernel alone, at a Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts,
top-8, expert width 768, bf16), against its plain-torch reference.

For each token count: both kernel paths' times (GEMV and grouped GEMM, to place the
``auto`` crossover), the path ``auto`` takes, its and the reference's times (CUDA events, median of
``--iters``), the bytes of the experts the step touches (each distinct expert's gate, up
and down once, plus activations) and the achieved fraction of ``--peak-gbps`` (H200:
4800 GB/s). Prints one JSON line per row.

    python3 benchmarks/fused_moe_kernel.py [--tokens 1 16 256] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtllm.worker.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from vtllm.worker.layers.moe import RouterSpec, select_experts  # noqa: E402


def _time_ms(fn, iters: int, *args) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--peak-gbps", type=float, default=4800.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    hidden, inter, experts = args.hidden, args.inter, args.experts
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=generator)
    w13 = (w13 / hidden**0.5).bfloat16()
    w2 = torch.randn(experts, hidden, inter, device=device, generator=generator) / inter**0.5
    w2 = w2.bfloat16()
    router = torch.randn(experts, hidden, device=device, generator=generator).bfloat16()
    expert_bytes = 3 * inter * hidden * 2
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, hidden, device=device, generator=generator).bfloat16()
        weights, ids = select_experts(x @ router.t(), RouterSpec(args.top_k))
        problem = (x, w13, w2, weights, ids)
        auto = "gemv" if num_tokens * args.top_k <= experts else "gemm"
        for _ in range(3):
            fused_moe(*problem, "silu", "gemv")
            fused_moe(*problem, "silu", "gemm")
        gemv_ms = _time_ms(fused_moe, args.iters, *problem, "silu", "gemv")
        gemm_ms = _time_ms(fused_moe, args.iters, *problem, "silu", "gemm")
        kernel_ms = gemv_ms if auto == "gemv" else gemm_ms
        ref_ms = _time_ms(fused_moe_ref, max(3, args.iters // 10), *problem)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * expert_bytes + 2 * x.numel() * 2
        gbps = nbytes / kernel_ms / 1e6
        actual, expected = fused_moe(*problem).float(), fused_moe_ref(*problem).float()
        error = (actual - expected).abs().max()
        print(json.dumps({
            "tokens": num_tokens, "auto_path": auto, "experts_touched": touched,
            "gemv_ms": round(gemv_ms, 4), "gemm_ms": round(gemm_ms, 4),
            "kernel_ms": round(kernel_ms, 4), "reference_ms": round(ref_ms, 3),
            "speedup_vs_reference": round(ref_ms / kernel_ms, 1),
            "expert_bytes_mb": round(nbytes / 1e6, 1), "gbps": round(gbps, 1),
            "roofline_fraction": round(gbps / args.peak_gbps, 3), "max_abs_err": float(error),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
