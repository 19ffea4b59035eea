"""The native int4 product alone (``q4_linear`` of ``worker/cpu_native_decode.py``, the
kernel every int4 linear of the native decode step runs) beside torch's float32 ``x @ W^T``
at the same shapes, in the same run.

    .venv/bin/python benchmarks/cpu_int4_product.py [--shapes 3072x576,576x1536,960x576] \
        [--rows 8,64,2048] [--repeats 5] [--threads 2]

Prints one JSON line per (shape, rows): GOP/s = 2 n k R / time, the median of
``--repeats`` timings (each the mean over enough calls to last ~0.2 s), the int4 product
and float32 alternating so that both see the same state of a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtllm.worker import native_build  # noqa: E402
from vtllm.worker.cpu_native_decode import Q4Weight, q4_linear  # noqa: E402


def seconds_per_call(function, min_seconds: float = 0.2) -> float:
    """Mean seconds of one call, over as many calls as fill ``min_seconds`` (after one)."""
    function()
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < min_seconds or calls < 3:
        function()
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="3072x576,576x1536,960x576", help="n x k, ...")
    parser.add_argument("--rows", default="8,64,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if native_build.library() is None:
        sys.exit("no C compiler: the native kernels are not built")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weight = torch.randn(n, k) * 0.05  # [n, k]
        q4 = Q4Weight(weight, None)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)  # [rows, k]
            int4, fp32 = [], []
            for _ in range(args.repeats):
                int4.append(seconds_per_call(lambda: q4_linear(q4, x)))  # noqa: B023
                fp32.append(seconds_per_call(lambda: x @ weight.T))  # noqa: B023
            ops = 2 * n * k * rows
            print(
                json.dumps(
                    {
                        "n": n,
                        "k": k,
                        "rows": rows,
                        "threads": args.threads,
                        "int4_gop_s": round(ops / statistics.median(int4) / 1e9, 1),
                        "float32_gop_s": round(ops / statistics.median(fp32) / 1e9, 1),
                    }
                ),  # fmt: skip
                flush=True,
            )


if __name__ == "__main__":
    main()
