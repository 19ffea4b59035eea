"""Sync vs ``--async-scheduling`` through the real engine core and worker processes
(``vtllm bench``), alternating the two in one invocation so both see the same machine.

The model is a tiny random Llama (``--model-shape`` of a 2-layer, 64-wide config), so the
forward is cheap and the host's work per step — the engine core's scheduling and output
handling, the IPC, the worker's input preparation — is what a step costs, as it is for a
small model on a GPU. ``VT_TEST_WORKER_STEP_DELAY_S`` then stands in for the device: the
worker sleeps that long in each step (the CPU is free meanwhile, as it is while a GPU
runs), which is the time async scheduling can hide the host's work behind.

    python benchmarks/async_scheduling.py                 # --delays-ms 0 2 --repeats 3

On a GPU, measure the real thing instead (no delay, a real shape), e.g.::

    vtllm bench latency --model-shape qwen3-0.6b --async-scheduling
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def bench(kind: str, shape: str, delay_ms: float, use_async: bool, args) -> dict:
    command = [sys.executable, "-m", "vtllm.cli", "bench", kind, "--model-shape", shape]
    command += ["--no-roofline", "--kv-cache-memory", "256MiB"]
    if kind == "latency":
        command += ["--input-len", "32", "--output-len", str(args.output_len)]
        command += ["--num-iters", "3"]
    else:
        command += ["--num-prompts", str(args.num_prompts)]
        command += ["--input-len-range", "16", "64", "--output-len-range", "64", "128"]
    if use_async:
        command.append("--async-scheduling")
    env = {
        **os.environ,
        "VT_CPU_COMPILE": "off",
        "VT_TEST_WORKER_STEP_DELAY_S": str(delay_ms / 1000),
        "VT_CPU_THREADS": "1",
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=32)
    args = parser.parse_args()
    shape = Path(tempfile.mkdtemp()) / "config.json"
    shape.write_text(json.dumps(TINY))
    for delay_ms in args.delays_ms:
        for kind, key in (("latency", "decode_tok_s"), ("throughput", "output_tok_s")):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for use_async in (False, True):
                    runs[use_async].append(bench(kind, str(shape), delay_ms, use_async, args)[key])
            sync, fast = statistics.median(runs[False]), statistics.median(runs[True])
            per_token = kind == "latency"  # batch 1: ms per token = ms per step
            print(
                f"{kind:10s} delay {delay_ms:g} ms  {key}: sync {sync:.1f}"
                + (f" ({1000 / sync:.2f} ms/token)" if per_token else "")
                + f" → async {fast:.1f}"
                + (f" ({1000 / fast:.2f} ms/token)" if per_token else "")
                + f"  ×{fast / sync:.2f}   runs sync {runs[False]} async {runs[True]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
