"""Accuracy of a KV-cache dtype (``--kv-cache-dtype``, default fp8) against the model's own
dtype, on a real model: the same prompts, greedy, teacher-forced (the second run continues
from the first run's tokens), compared step by step.

    .venv/bin/python benchmarks/kv_cache_dtype_accuracy.py [--model DIR] [--steps 48]

Default model: the embedded SmolLM2-135M-Instruct (converted once into VT_CACHE_DIR). On a
GPU the model runs in bf16 through the Triton kernels; on CPU in fp32 through the kernels'
torch references (the only CPU attention that reads FP8 caches). Prints one JSON object:
greedy picks that agree, and the worst / mean |Δ logprob| of the reference's pick.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.worker.kv_dtype_runs import compare_runs, greedy_run  # noqa: E402
from vtllm import envs  # noqa: E402
from vtllm.worker.kv_cache_dtype import resolve_kv_cache_dtype  # noqa: E402
from vtllm.worker.loader.gguf_convert import resolve_model_dir  # noqa: E402
from vtllm.worker.platform import detect_platform  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="HF-style model directory (default: embedded)")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--steps", type=int, default=48, help="decode steps after the prefill")
    args = parser.parse_args()
    model_dir = args.model or resolve_model_dir(None, envs.VT_CACHE_DIR)
    platform = detect_platform(0)
    dtype = torch.bfloat16 if platform.is_gpu else torch.float32
    if platform.is_gpu:
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, platform, "triton")
    else:  # the worker refuses fp8 on CPU; the kernels' references read it here
        kv_dtype = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}.get(
            args.kv_cache_dtype
        ) or resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, platform, "triton")
    started = time.monotonic()
    reference = greedy_run(model_dir, platform, dtype, None, args.steps)
    actual = greedy_run(model_dir, platform, dtype, kv_dtype, args.steps, forced=reference)
    agree, picks, worst, mean = compare_runs(reference, actual)
    print(
        json.dumps(
            {
                "model": str(model_dir),
                "device": str(platform.device),
                "dtype": str(dtype),
                "kv_cache_dtype": str(kv_dtype),
                "reference_kv_cache_dtype": str(dtype),
                "picks": picks,
                "picks_agree": agree,
                "worst_abs_dlogprob": round(worst, 4),
                "mean_abs_dlogprob": round(mean, 4),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
