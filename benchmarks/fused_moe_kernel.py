"""The fused-MoE kernel alone, at a Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts,
top-8, expert width 768, bf16), against its plain-torch reference.

For each token count: the grouped path's pair sort (``moe_align``'s kernels vs its torch
twin, graph-timed), both kernel paths' times (GEMV and grouped GEMM, to place the
``auto`` crossover), the path ``auto`` takes, its and the reference's times (CUDA events, median of
``--iters``), the bytes of the experts the step touches (each distinct expert's gate, up
and down once, plus activations) and the achieved fraction of ``--peak-gbps`` (H200:
4800 GB/s). Prints one JSON line per row.

    python3 benchmarks/fused_moe_kernel.py [--tokens 1 16 256] [--iters 50]

``--sweep`` times the decode path instead, inside device graphs of 20 calls (each call its
own top-k, so L2 does not hold the experts; no launch overhead): every gate/up GEMV and
down-and-sum launch configuration at ``--tokens`` (the default first), and the whole
routed layer (router projection + routing + experts) with the routing kernel and with the
torch routing it replaced (the baseline, same run):

    python3 benchmarks/fused_moe_kernel.py --sweep --tokens 1 4 16 [--fp8]

(``--fp8``: the experts in e4m3 with one scale a row, as ``--quantization fp8`` makes them.)

``--sweep-router`` times the router alone at ``--tokens`` (up to 8), in device graphs over
20 routers (so that L2 does not hold them): the router GEMM then the routing kernel (the
baseline, same run) against the fused router-and-routing kernel at each launch
configuration (experts a program, hidden-dim step, warps, packed top-k), and the RMSNorm
kernel before the router against the norm folded into it (``moe_norm_router_route``,
default tiles):

    python3 benchmarks/fused_moe_kernel.py --sweep-router --tokens 1 8

``--sweep-gemm`` does the same for the grouped-GEMM path (prefill and large decode batches:
``--tokens 64 256 1024 8192``): the gate/up GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages) with the down GEMM at its default, then the down GEMM's with the gate/up at its
default (BLOCK_M is shared: one alignment serves both), each row with the bytes of the
experts the call touches and the fraction of ``--peak-gbps`` it streams them at. With
``--fp8`` the experts are e4m3 and the GEMMs w8a8 (``--block-scales``: 128×128 blocks, else
one scale a row); BLOCK_K 256 joins the sweep with row scales.

``--w8a8`` times the grouped path (``--tokens 256 1024 8192``) over bf16 experts, then
e4m3 experts (per-row and 128×128 block scales) dotted in bf16 (w8a16: each weight tile
converted) and with e4m3 activations (w8a8, ``fp8_activations``: the inputs quantised per
token or per K block, fp8 × fp8 dots), graph-timed with a fresh top-k per call, each with
its error against the bf16 experts:

    python3 benchmarks/fused_moe_kernel.py --w8a8 --tokens 256 1024 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtllm.worker.kernels import fused_moe as moe_kernels  # noqa: E402
from vtllm.worker.kernels import fused_moe_decode as decode_kernels  # noqa: E402
from vtllm.worker.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from vtllm.worker.kernels.moe_align import align_pairs_by_expert, align_pairs_by_expert_ref  # noqa: E402
from vtllm.worker.kernels.moe_routing import (  # noqa: E402
    MAX_FUSED_ROUTER_TOKENS,
    RouterTiles,
    moe_norm_router_route,
    moe_route_ref,
    moe_router_route,
)
from vtllm.worker.kernels.rms_norm import rms_norm  # noqa: E402
from vtllm.worker.layers.moe import RouterSpec, select_experts  # noqa: E402
from vtllm.worker.platform import detect_platform  # noqa: E402


def _random_calls(args, num_tokens: int, device) -> tuple:
    """``(x [T, H] bf16, weights [T, k], ids)``: equal routing weights and 20 random top-k
    id tensors ``[T, k]`` int32, one a call of a graph (so that L2 does not hold the
    experts between calls)."""
    x = torch.randn(num_tokens, args.hidden, device=device).bfloat16()
    ids = [
        torch.stack([torch.randperm(args.experts, device=device)[: args.top_k] for _ in x]).to(
            torch.int32
        )
        for _ in range(20)
    ]
    weights = torch.full((num_tokens, args.top_k), 1.0 / args.top_k, device=device)
    return x, weights, ids


def _fp8_experts(w13, w2, fp8_dtype, block) -> tuple:
    """``(w13, w2, scales)``: the experts in e4m3 with one scale a row (``block`` None, as
    ``--quantization fp8`` makes them) or per ``block``, and ``fused_moe``'s scale kwargs."""
    from vtllm.worker.kernels.moe_common import ExpertScales
    from vtllm.worker.layers.fp8 import quantize_blocks, quantize_rows

    if block is None:
        (w13, s13), (w2, s2) = (quantize_rows(w, fp8_dtype) for w in (w13, w2))
    else:
        (w13, s13), (w2, s2) = (quantize_blocks(w, block, fp8_dtype) for w in (w13, w2))
    return w13, w2, dict(w13_scales=ExpertScales(s13, block), w2_scales=ExpertScales(s2, block))


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


def sweep_decode(args, w13, w2, router) -> None:
    """JSON lines: microseconds per call of each decode-path launch configuration, and of
    the routed layer with kernel vs torch routing (see the module docstring). With
    ``--fp8`` the experts are e4m3 with one scale a row (``--quantization fp8``)."""
    import itertools

    platform = detect_platform(0)
    scales = (None, None)
    if args.fp8:
        w13, w2, kwargs = _fp8_experts(w13, w2, platform.fp8_dtype, None)
        scales = (kwargs["w13_scales"], kwargs["w2_scales"])
    device, hidden = platform.device, args.hidden
    spec = RouterSpec(args.top_k, round_weights=True)  # Qwen3-MoE's router
    gemv_tiles, down_tiles = decode_kernels._gemv_tiles, decode_kernels._down_sum_tiles
    for num_tokens in args.tokens:
        x, weights, ids = _random_calls(args, num_tokens, device)

        def experts_only(i, x=x, weights=weights, ids=ids):
            return fused_moe(x, w13, w2, weights, ids[i], "silu", "gemv", *scales)

        default = (gemv_tiles(num_tokens * args.top_k, args.inter, hidden, device, w13.element_size()),
                   down_tiles(num_tokens, hidden, args.inter, device))  # fmt: skip
        # gate/up tiles hold [BLOCK_N, BLOCK_K] twice, down tiles [top_k, BLOCK_N, BLOCK_K]:
        # at most 16K and 32K elements (narrow N with long K won the dense GEMV's sweep)
        gate_grid = itertools.product((2, 4, 8, 16, 32, 64), (128, 256, 512, 1024), (4, 8))
        down_grid = itertools.product((2, 4, 8, 16, 32), (64, 128, 256, 512), (4, 8))
        configs = [default]
        configs += [(g, default[1]) for g in gate_grid if g[0] * g[1] <= 16384]
        configs += [(default[0], d) for d in down_grid if d[0] * d[1] * args.top_k <= 32768]
        for gemv, down in configs:
            decode_kernels._gemv_tiles = lambda *_, gemv=gemv: gemv
            decode_kernels._down_sum_tiles = lambda *_, down=down: down
            try:
                us = platform.graph_us(experts_only)
            except Exception as error:  # a configuration the compiler refuses
                us = f"failed: {type(error).__name__}"
            print(json.dumps({"tokens": num_tokens, "gemv_tiles": gemv, "down_sum_tiles": down,
                              "default": (gemv, down) == default, "us": us}), flush=True)  # fmt: skip
        decode_kernels._gemv_tiles, decode_kernels._down_sum_tiles = gemv_tiles, down_tiles
        for routing, route in (
            ("kernel", select_experts), ("torch", _torch_route), ("fused", None),
        ):  # fmt: skip
            if route is None and num_tokens > MAX_FUSED_ROUTER_TOKENS:
                continue

            def layer(i, route=route, x=x):
                if route is None:  # router linear and routing in one kernel
                    topk_weights, topk_ids = moe_router_route(
                        x, router[i % 4], spec.top_k, round_weights=True
                    )
                else:
                    logits = x @ router[i % 4].t()  # [T, E]
                    topk_weights, topk_ids = route(logits, spec)
                return fused_moe(x, w13, w2, topk_weights, topk_ids, "silu", "auto", *scales)

            us = platform.graph_us(layer)
            print(json.dumps({"tokens": num_tokens, "layer_with_routing": routing, "us": round(us, 1)}),
                  flush=True)  # fmt: skip


def sweep_router(args, routers) -> None:
    """JSON lines: microseconds per router call (router GEMM + routing kernel, then the
    fused kernel at each ``RouterTiles``), see the module docstring."""
    import itertools

    platform = detect_platform(0)
    spec = RouterSpec(args.top_k, round_weights=True)  # Qwen3-MoE's router
    norm_weight = torch.ones(args.hidden, device=platform.device, dtype=torch.bfloat16)
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, args.hidden, device=platform.device).bfloat16()

        def unfused(i, x=x):
            return select_experts(x @ routers[i].t(), spec)

        residual = torch.randn_like(x)

        def norm_unfused(i, x=x, residual=residual):  # the RMSNorm kernel, then the above
            h, _ = rms_norm(x, norm_weight, 1e-6, residual)
            return select_experts(h @ routers[i].t(), spec)

        def norm_fused(i, x=x, residual=residual):
            return moe_norm_router_route(x, residual, norm_weight, 1e-6, routers[i],
                                         spec.top_k, round_weights=True)  # fmt: skip

        for name, fn in (("gemm+route", unfused), ("norm+gemm+route", norm_unfused),
                         ("norm-fused", norm_fused)):  # fmt: skip
            us = platform.graph_us(fn)
            print(json.dumps({"tokens": num_tokens, "router": name, "us": round(us, 2)}),
                  flush=True)  # fmt: skip
        default = RouterTiles()
        grid = [  # (block_n, block_k, warps, packed top-k, rank top-k)
            (*g, topk == "packed", topk == "rank")
            for g in itertools.product((2, 4, 8), (1024, 2048), (1, 2, 4))
            for topk in ("two-pass", "packed", "rank")
        ]
        for tiles in [default, *(RouterTiles(*g) for g in grid if RouterTiles(*g) != default)]:

            def fused(i, x=x, tiles=tiles):
                return moe_router_route(x, routers[i], spec.top_k, round_weights=True,
                                        tiles=tiles)  # fmt: skip

            try:
                us = round(platform.graph_us(fused), 2)
            except Exception as error:  # a configuration the compiler refuses
                us = f"failed: {type(error).__name__}"
            print(json.dumps({"tokens": num_tokens, "router": "fused", "tiles": tiles.__dict__,
                              "default": tiles == default, "us": us}), flush=True)  # fmt: skip


def sweep_gemm(args, w13, w2) -> None:
    """JSON lines: microseconds per grouped-GEMM ``fused_moe`` call for each launch
    configuration (see the module docstring), graph-timed, a fresh top-k per call."""
    import itertools

    platform = detect_platform(0)
    device, hidden, experts = platform.device, args.hidden, args.experts
    gemm_tiles = moe_kernels._gemm_tiles
    extra, k_steps = {}, (64, 128)
    if args.fp8:  # e4m3 experts, w8a8 (per-row scales, or 128x128 blocks)
        block = (128, 128) if args.block_scales else None
        w13, w2, extra = _fp8_experts(w13, w2, platform.fp8_dtype, block)
        extra["fp8_activations"] = True
        k_steps = (64, 128) if block else (64, 128, 256)
    expert_bytes = 3 * args.inter * hidden * w13.element_size()
    for num_tokens in args.tokens:
        x, weights, ids = _random_calls(args, num_tokens, device)
        touched = sum(int(torch.unique(one).numel()) for one in ids) / len(ids)

        def experts_only(i, x=x, weights=weights, ids=ids):
            return fused_moe(x, w13, w2, weights, ids[i], "silu", "gemm", **extra)

        pairs = num_tokens * args.top_k
        fp8_modes = (bool(args.fp8), bool(args.fp8 and args.block_scales))
        default = (
            gemm_tiles(pairs, experts, True, *fp8_modes),
            gemm_tiles(pairs, experts, False, *fp8_modes),
        )
        configs = [default] + [
            (g, default[1])
            for g in itertools.product((16, 32, 64, 128), (64, 128), k_steps, (4, 8), (3, 4))
        ]
        configs += [
            (default[0], (default[0][0], *d))
            for d in itertools.product((64, 128), k_steps, (4, 8), (3, 4))
        ]
        for gate_up, down in configs:
            moe_kernels._gemm_tiles = lambda _p, _e, gated, *_, g=gate_up, d=down: g if gated else d
            try:
                us = platform.graph_us(experts_only, calls=10, replays=5)
                gbps = touched * expert_bytes / us / 1e3
                fraction = round(gbps / args.peak_gbps, 3)
                us = round(us, 1)
            except Exception as error:  # a configuration the compiler refuses
                us, fraction = f"failed: {type(error).__name__}", None
            print(json.dumps({"tokens": num_tokens, "gate_up_tiles": gate_up, "down_tiles": down,
                              "default": (gate_up, down) == default, "us": us,
                              "roofline_fraction": fraction}), flush=True)  # fmt: skip
        moe_kernels._gemm_tiles = gemm_tiles


def compare_w8a8(args, w13, w2) -> None:
    """JSON lines: microseconds per grouped-GEMM call, bf16 vs w8a16 vs w8a8 experts."""
    platform = detect_platform(0)
    device, fp8 = platform.device, platform.fp8_dtype
    quantised = {"row": _fp8_experts(w13, w2, fp8, None)}
    quantised["block-128"] = _fp8_experts(w13, w2, fp8, (128, 128))
    for num_tokens in args.tokens:
        x, weights, ids = _random_calls(args, num_tokens, device)
        exact = fused_moe(x, w13, w2, weights, ids[0], "silu", "gemm").float()
        cases = [("bf16", (w13, w2), {})]
        for scale_kind, (q13, q2, scales) in quantised.items():
            cases.append((f"w8a16 {scale_kind}", (q13, q2), scales))
            cases.append((f"w8a8 {scale_kind}", (q13, q2), scales | {"fp8_activations": True}))
        for name, (a, b), extra in cases:

            def call(i, a=a, b=b, extra=extra, x=x, weights=weights, ids=ids):
                return fused_moe(x, a, b, weights, ids[i], "silu", "gemm", **extra)

            us = platform.graph_us(call, calls=10, replays=5)
            error = (call(0).float() - exact).norm() / exact.norm()
            print(json.dumps({"tokens": num_tokens, "experts": name, "us": round(us, 1),
                              "rms_error_vs_bf16": round(float(error), 4)}), flush=True)  # fmt: skip


def _torch_route(logits, spec):
    """The torch routing the kernel replaced (several small kernels)."""
    return moe_route_ref(logits, spec.top_k, spec.scoring, spec.renormalize, spec.round_weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--peak-gbps", type=float, default=4800.0)
    parser.add_argument("--sweep", action="store_true", help="decode-path configurations")
    parser.add_argument("--sweep-gemm", action="store_true", help="grouped-GEMM configurations")
    parser.add_argument("--sweep-router", action="store_true", help="router configurations")
    parser.add_argument(
        "--fp8", action="store_true", help="--sweep / --sweep-gemm over e4m3 experts (row scales)"
    )
    parser.add_argument(
        "--block-scales", action="store_true", help="with --fp8 --sweep-gemm: 128x128 blocks"
    )
    parser.add_argument("--w8a8", action="store_true", help="grouped GEMMs: bf16, w8a16, w8a8")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    hidden, inter, experts = args.hidden, args.inter, args.experts
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=generator)
    w13 = (w13 / hidden**0.5).bfloat16()
    w2 = torch.randn(experts, hidden, inter, device=device, generator=generator) / inter**0.5
    w2 = w2.bfloat16()
    router = torch.randn(experts, hidden, device=device, generator=generator).bfloat16()
    if args.sweep_gemm:
        sweep_gemm(args, w13, w2)
        return
    if args.w8a8:
        compare_w8a8(args, w13, w2)
        return
    if args.sweep_router:
        routers = torch.randn(20, experts, hidden, device=device, generator=generator)
        sweep_router(args, (routers / hidden**0.5).bfloat16())
        return
    if args.sweep:
        routers = torch.randn(4, experts, hidden, device=device, generator=generator).bfloat16()
        sweep_decode(args, w13, w2, routers)
        return
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
        platform = detect_platform(0)
        align_us = {  # the grouped path's pair sort: kernels vs the torch twin (graph-timed)
            name: round(platform.graph_us(lambda i, fn=fn, ids=ids: fn(ids, experts, 64)), 1)
            for name, fn in (
                ("kernels", align_pairs_by_expert),
                ("torch", align_pairs_by_expert_ref),
            )
        }
        touched = int(torch.unique(ids).numel())
        nbytes = touched * expert_bytes + 2 * x.numel() * 2
        gbps = nbytes / kernel_ms / 1e6
        actual, expected = fused_moe(*problem).float(), fused_moe_ref(*problem).float()
        error = (actual - expected).abs().max()
        print(json.dumps({
            "tokens": num_tokens, "auto_path": auto, "experts_touched": touched,
            "gemv_ms": round(gemv_ms, 4), "gemm_ms": round(gemm_ms, 4),
            "kernel_ms": round(kernel_ms, 4), "reference_ms": round(ref_ms, 3),
            "speedup_vs_reference": round(ref_ms / kernel_ms, 1), "align_us": align_us,
            "expert_bytes_mb": round(nbytes / 1e6, 1), "gbps": round(gbps, 1),
            "roofline_fraction": round(gbps / args.peak_gbps, 3), "max_abs_err": float(error),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
