"""Where a decode step's time goes inside one worker (no engine core, no IPC).

Builds the ModelRunner of a ``--model-shape`` (random bf16 weights) on the GPU, prefills
``--batch`` prompts, then times ``--steps`` decode steps three ways: the whole
``ModelRunner.execute``, the graph replay (or eager forward) alone, and a cProfile of the
host side. Prints JSON lines and the top host functions.

    python3 benchmarks/profile_decode.py --model-shape qwen3-0.6b --batch 1 [--eager]
    python3 benchmarks/profile_decode.py --model-shape llama3-8b --batch 256 --prompt-len 768

With graphs, the small-batch linears are timed and picked first (GEMV or the library, the
fused decode chain), as the worker's start-up does unless ``VT_SMALL_BATCH_GEMV=off``, so
the profile shows the kernels the engine runs.

``--kernels`` adds the device side: ``torch.profiler`` over ``--steps`` steps, the kernels
by total device time with their launches per step (under graphs the profiler sees the
replayed kernels where the CUDA version reports them; else run it with ``--eager``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "worker"))

from tiny_models import EngineSim  # noqa: E402

from vtllm import envs  # noqa: E402
from vtllm.bench import write_shape_dir  # noqa: E402
from vtllm.protocol.messages import SamplingParams, SchedulerOutput  # noqa: E402
from vtllm.worker.kv_cache_dtype import resolve_kv_cache_dtype  # noqa: E402
from vtllm.worker.layers.small_batch import tune_small_batch_linears  # noqa: E402
from vtllm.worker.model_runner import ModelRunner, attention_backend  # noqa: E402
from vtllm.worker.platform import detect_platform  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--prompt-len", type=int, default=32,
        help="prompt tokens a request (the decode steps' context starts here)",
    )  # fmt: skip
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="a table of device kernels")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="as vtllm's flag (fp8: an e4m3 cache)"
    )
    args = parser.parse_args()
    platform = detect_platform(0)
    model_dir = write_shape_dir(args.model_shape)
    kv_cache_dtype = resolve_kv_cache_dtype(
        args.kv_cache_dtype, torch.bfloat16, platform, attention_backend(platform.device)
    )
    runner = ModelRunner.from_model_dir(
        model_dir, platform.device, torch.bfloat16, seed=0, load_format="dummy",
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    # every request's prompt plus the warm-up and the three timed passes of decode steps
    blocks_a_request = -(-(args.prompt_len + 20 + 3 * args.steps + 1) // 16)
    num_blocks = max(1024, args.batch * blocks_a_request + 1)
    runner.init_kv_cache(num_blocks=num_blocks, block_size=16)
    if not args.eager:
        if envs.VT_SMALL_BATCH_GEMV == "auto":  # what the worker's start-up does first
            tune_small_batch_linears(runner.model, platform, torch.bfloat16)
        runner.capture_decode_graphs(platform, max(8, args.batch), 4096)
    engine = EngineSim(runner.execute, num_blocks=num_blocks, block_size=16)
    for i in range(args.batch):
        engine.add(f"r{i}", [100 + i] * args.prompt_len, SamplingParams(temperature=0.0))
    # the prompts in steps of at most ~8,192 tokens (as --max-num-batched-tokens would)
    prompts_a_step = max(1, 8192 // args.prompt_len)
    request_ids = list(engine.requests)
    for first in range(0, len(request_ids), prompts_a_step):
        engine.step({rid: args.prompt_len for rid in request_ids[first : first + prompts_a_step]})
    schedule = {rid: 1 for rid in engine.requests}
    for _ in range(20):  # warm-up
        engine.step(schedule)
    platform.synchronize()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step(schedule)
    per_step = (time.perf_counter() - started) / args.steps

    batch = runner.states.build_step(_step_like(schedule), runner.block_size)
    platform.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(args.steps):
            runner._forward_logits(batch)
        platform.synchronize()
    forward = (time.perf_counter() - started) / args.steps

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step(schedule)
    profile.disable()
    print(
        json.dumps(
            {
                "model": args.model_shape,
                "batch": args.batch,
                "graphs": not args.eager,
                "execute_ms": round(per_step * 1e3, 3),
                "forward_and_logits_ms": round(forward * 1e3, 3),
            }
        ),
        flush=True,
    )
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    if args.kernels:
        print_kernel_table(lambda: engine.step(schedule), args.steps, platform)


def print_kernel_table(step, steps: int, platform) -> None:
    """Device kernels of ``steps`` calls of ``step``: per kernel name, the device
    microseconds a step and launches a step, largest first (top 40), and the total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        platform.synchronize()
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]  # kernels, copies
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows) / steps
    print(json.dumps({"device_us_per_step": round(total, 1), "kernels": len(rows)}))
    for e in rows[:40]:
        print(
            f"{e.self_device_time_total / steps:9.1f} us/step {e.count / steps:7.1f} launches/step  "
            f"{e.key[:110]}"
        )


def _step_like(schedule: dict[str, int]) -> SchedulerOutput:
    """A SchedulerOutput carrying only the schedule (the runner already holds the state)."""
    return SchedulerOutput(
        step_id=-1, new_requests=[], cached_requests=[], num_scheduled_tokens=dict(schedule)
    )


if __name__ == "__main__":
    main()
