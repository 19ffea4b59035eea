"""Batch-1 decode of one worker in bf16 and with FP8 weights (``--quantization fp8``), same
random weights, same run: step time, the bytes a step must read, and how far the FP8
model's logprobs move from the bf16 ones.

For each quantisation (none, then fp8) it builds the ModelRunner of ``--model-dir`` (a
directory holding a config.json, weights random: ``--load-format dummy``, quantised at load
for fp8), captures decode graphs, prefills one 32-token prompt and times ``--steps``
teacher-forced decode steps (graph replays through ``ModelRunner.execute``); another request
first records full-vocab logprobs of its prefill and 16 decodes for the comparison. "Touched bytes"
count what one batch-1 step must read: every parameter except the input embedding, with
each MoE layer's experts counted at ``top_k / num_experts`` of their bytes (one token
touches top_k experts). Prints one JSON line per quantisation and one comparing them.

    python3 benchmarks/fp8_decode.py --model-shape qwen3-30b-a3b [--steps 100]
    python3 benchmarks/fp8_decode.py --model-dir DIR  # any config.json
    python3 benchmarks/fp8_decode.py --model-shape qwen3-30b-a3b --sweep 1  # dense tiles
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "worker"))

from tiny_models import EngineSim, full_logprobs  # noqa: E402

from vtllm.bench import measure_copy_bandwidth, write_shape_dir  # noqa: E402
from vtllm.protocol.messages import ModelRunnerOutput, SamplingParams  # noqa: E402
from vtllm.worker.layers.moe import FusedMoE  # noqa: E402
from vtllm.worker.model_runner import ModelRunner  # noqa: E402
from vtllm.worker.platform import detect_platform  # noqa: E402

PROMPT = [100 + i for i in range(32)]


def touched_bytes(runner: ModelRunner, top_k: int) -> int:
    """Bytes one batch-1 decode step reads (module docstring)."""
    model = runner.model
    total = runner.weight_bytes()
    total -= (
        model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    )
    if model.lm_head.weight is model.model.embed_tokens.weight:  # tied: the head reads it all
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            experts = sum(p.numel() * p.element_size() for p in module.parameters())
            total -= experts - experts * top_k // module.num_experts
    return total


def run(model_dir: str, quantization: str | None, steps: int, vocab: int, top_k: int) -> dict:
    platform = detect_platform(0)
    started = time.monotonic()
    runner = ModelRunner.from_model_dir(
        model_dir, platform.device, torch.bfloat16, 0, load_format="dummy",
        quantization=quantization,
    )  # fmt: skip
    load_s = time.monotonic() - started
    runner.init_kv_cache(num_blocks=64, block_size=16)
    runner.capture_decode_graphs(platform, 1, 1024, platform.supports_graphs, sizes=[1])
    rows: list[torch.Tensor] = []
    forced = [(7 * i + 11) % vocab for i in range(steps + 128)]

    def execute(step):
        output = runner.execute(step)
        if output.top_logprobs and output.top_logprobs[0]:
            rows.append(full_logprobs(output, 0, vocab))
        ids = output.request_ids
        return ModelRunnerOutput(step.step_id, ids, [forced[step.step_id]] * len(ids))

    engine = EngineSim(execute, num_blocks=64, block_size=16)
    # accuracy: full-vocab logprobs of a prefill and 16 decodes
    engine.add("accuracy", PROMPT, SamplingParams(temperature=0.0, logprobs=vocab))
    engine.step({"accuracy": len(PROMPT)})
    for _ in range(16):
        engine.step({"accuracy": 1})
    engine.finish("accuracy")
    # speed: a plain greedy request, graph replays after a warm-up
    engine.add("speed", PROMPT, SamplingParams(temperature=0.0))
    engine.step({"speed": len(PROMPT)})
    for _ in range(16):
        engine.step({"speed": 1})
    platform.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step({"speed": 1})
    platform.synchronize()
    step_s = (time.perf_counter() - started) / steps
    result = {
        "quantization": quantization or "none",
        "load_s": round(load_s, 1),
        "weight_gib": round(runner.weight_bytes() / 2**30, 2),
        "touched_gib": round(touched_bytes(runner, top_k) / 2**30, 3),
        "step_ms": round(step_s * 1e3, 3),
        "decode_tok_s": round(1 / step_s, 1),
        "_logprobs": torch.stack(rows),
    }
    return result


def _dense_times(platform, n: int, k: int) -> dict:
    """One token through an ``[n, k]`` projection: bf16, FP8 per-row, FP8 128x128 blocks."""
    from vtllm.worker.kernels.fp8_matmul import fp8_matmul
    from vtllm.worker.layers.fp8 import quantize_blocks, quantize_rows

    copies = 20  # 20 distinct weights: together past the 50 MB L2 of an H200
    w = [
        torch.randn(n, k, device=platform.device, dtype=torch.bfloat16) * 0.02
        for _ in range(copies)
    ]
    x = torch.randn(1, k, device=platform.device, dtype=torch.bfloat16)
    rows = [quantize_rows(one, platform.fp8_dtype) for one in w]
    blocks = [quantize_blocks(one, (128, 128), platform.fp8_dtype) for one in w]
    return {
        "bf16_us": platform.graph_us(lambda i: torch.nn.functional.linear(x, w[i])),
        "fp8_row_us": platform.graph_us(
            lambda i: fp8_matmul(x, rows[i][0], rows[i][1][:, None], (1, k))
        ),
        "fp8_block_us": platform.graph_us(
            lambda i: fp8_matmul(x, blocks[i][0], blocks[i][1], (128, 128))
        ),
    }


def sweep_dense_tiles(config: dict, tokens: int) -> list[dict]:
    """``fp8_matmul`` launch configurations for the qkv and o projections at ``tokens``
    rows (per-channel and 128x128 block scales): microseconds each, bf16 ``F.linear`` and
    the default configuration first."""
    import itertools

    from vtllm.worker.kernels.fp8_matmul import Tiles, _tiles, fp8_matmul
    from vtllm.worker.layers.fp8 import quantize_blocks, quantize_rows

    platform = detect_platform(0)
    hidden, head_dim, heads = (
        config["hidden_size"],
        config["head_dim"],
        config["num_attention_heads"],
    )
    qkv = (heads + 2 * config["num_key_value_heads"]) * head_dim
    results = []
    for name, (n, k) in {"qkv": (qkv, hidden), "o": (hidden, heads * head_dim)}.items():
        w = [torch.randn(n, k, device=platform.device, dtype=torch.bfloat16) for _ in range(20)]
        x = torch.randn(tokens, k, device=platform.device, dtype=torch.bfloat16)
        bf16_us = platform.graph_us(lambda i, x=x, w=w: torch.nn.functional.linear(x, w[i]))
        results.append({"proj": name, "scales": "bf16 (cuBLAS)", "us": round(bf16_us, 1)})
        for kind, quantize, block in (
            ("row", lambda t: quantize_rows(t, platform.fp8_dtype), (1, k)),
            ("block", lambda t: quantize_blocks(t, (128, 128), platform.fp8_dtype), (128, 128)),
        ):
            weights = [quantize(one) for one in w]
            if kind == "row":
                weights = [(q, s[:, None]) for q, s in weights]
            default = _tiles(tokens, n, block, kind == "row", platform.device)
            block_ks = (128, 256, 512) if kind == "row" else (64, 128)
            candidates = [default] + [
                Tiles(16 if tokens <= 16 else 64, bn, bk, warps, stages)
                for bn, bk, warps, stages in itertools.product((16, 32, 64), block_ks, (4,), (3, 5))
            ]
            for tiles in candidates:
                us = platform.graph_us(
                    lambda i, x=x, ws=weights, block=block, tiles=tiles: fp8_matmul(
                        x, *ws[i], block, tiles
                    ),
                )
                results.append(
                    {"proj": name, "scales": kind, "tiles": tiles.__dict__, "us": round(us, 1)}
                )
    return results


def kernel_times(config: dict) -> dict:
    """One token through the dense projections and one MoE layer of ``config``: bf16 vs
    the FP8 kernels (per-row and 128x128 block scales), microseconds per call."""
    from vtllm.worker.kernels.fused_moe import ExpertScales, fused_moe
    from vtllm.worker.layers.fp8 import quantize_rows

    platform = detect_platform(0)
    device, fp8 = platform.device, platform.fp8_dtype
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    times = {}
    o_in = config["num_attention_heads"] * head_dim
    for name, (n, k) in {"qkv": (qkv, hidden), "o": (hidden, o_in)}.items():
        times |= {f"{name}_{kind}": us for kind, us in _dense_times(platform, n, k).items()}
    num_experts, inter = config.get("num_experts", 0), config.get("moe_intermediate_size", 0)
    if num_experts:
        top_k = config["num_experts_per_tok"]
        w13 = (
            torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02
        )
        w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
        ids = [  # a different top-k per call
            torch.randperm(num_experts, device=device)[:top_k][None].to(torch.int32)
            for _ in range(20)
        ]
        weights = torch.full((1, top_k), 1.0 / top_k, device=device)
        times["moe_bf16_us"] = platform.graph_us(lambda i: fused_moe(x, w13, w2, weights, ids[i]))
        (q13, s13), (q2, s2) = quantize_rows(w13, fp8), quantize_rows(w2, fp8)
        scales = ExpertScales(s13, None), ExpertScales(s2, None)
        times["moe_fp8_row_us"] = platform.graph_us(
            lambda i: fused_moe(
                x, q13, q2, weights, ids[i], w13_scales=scales[0], w2_scales=scales[1]
            ),
        )
        del w13, w2, q13, q2
    return {k: round(v, 1) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", help="a directory with a config.json")
    parser.add_argument("--model-shape", help="a vtllm bench --model-shape name instead")
    parser.add_argument(
        "--sweep",
        type=int,
        metavar="TOKENS",
        help="only time fp8_matmul launch configurations at TOKENS rows (default first)",
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--kernels-only", action="store_true", help="only the per-kernel batch-1 table"
    )
    args = parser.parse_args()
    if args.model_shape:
        args.model_dir = str(write_shape_dir(args.model_shape))
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    vocab, top_k = config["vocab_size"], config.get("num_experts_per_tok", 1)
    if args.sweep:
        for row in sweep_dense_tiles(config, args.sweep):
            print(json.dumps(row), flush=True)
        return
    bandwidth = measure_copy_bandwidth()
    print(json.dumps({"kernels_batch_1": kernel_times(config)}), flush=True)
    if args.kernels_only:
        return
    results = []
    for quantization in (None, "fp8"):
        results.append(run(args.model_dir, quantization, args.steps, vocab, top_k))
        gc.collect()  # the runner of the last run, before the next one allocates
        detect_platform(0).empty_cache()
    logprobs = [r.pop("_logprobs") for r in results]
    for r in results:
        gb_s = r["touched_gib"] * 2**30 / (r["step_ms"] / 1e3) / 1e9
        r |= {"touched_gb_s": round(gb_s, 1), "roofline_fraction": round(gb_s * 1e9 / bandwidth, 3)}
        print(json.dumps({"model": config.get("architectures"), **r}), flush=True)
    difference = (logprobs[1] - logprobs[0]).abs()
    agree = (logprobs[1].argmax(-1) == logprobs[0].argmax(-1)).float().mean()
    print(
        json.dumps(
            {
                "fp8_speedup": round(results[0]["step_ms"] / results[1]["step_ms"], 3),
                "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "rows_compared": len(difference),
                "max_abs_dlogprob": round(float(difference.max()), 4),
                "mean_abs_dlogprob": round(float(difference.mean()), 5),
                "argmax_agreement": round(float(agree), 3),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
