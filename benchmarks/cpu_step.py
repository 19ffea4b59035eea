"""The embedded SmolLM2's CPU steps inside one worker (no engine core, no HTTP): decode
step time at batch 1 and batch N, and one prefill of a long prompt, as ``vtllm serve``
runs them (its default CPU quantisation unless ``--quantization`` says otherwise, the
native decode step of ``worker/cpu_native_decode.py`` unless ``--no-native`` or
``--eager``, and the compiled steps of ``worker/cpu_compile.py`` unless ``--eager``).

    .venv/bin/python benchmarks/cpu_step.py [--batch 8] [--steps 40] [--prefill 2048] \
        [--quantization int4|int8|none] [--threads 2] [--eager] [--no-native] [--profile]

Prints one JSON line per figure: the median and the spread (min..max) of ``--repeats``
timings. ``--profile``: a ``torch.profiler`` table of ten batch-1 decode steps (op time
by op, CPU total) after the timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "worker"))

from tiny_models import EngineSim  # noqa: E402

from vtllm.protocol.messages import SamplingParams  # noqa: E402
from vtllm.worker.layers.cpu_quant import choose_quantization, fast_int4_cpu  # noqa: E402
from vtllm.worker.loader.gguf_convert import resolve_model_dir  # noqa: E402
from vtllm.worker.loader.hf_config import load_hf_config  # noqa: E402
from vtllm.worker.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 1024
GREEDY = SamplingParams(temperature=0.0)


def decode_times(runner: ModelRunner, batch: int, steps: int, repeats: int) -> list[float]:
    """Seconds per decode step of ``batch`` requests (64-token prompts), ``repeats`` runs
    of ``steps`` steps each, after a warm-up."""
    engine = EngineSim(runner.execute, NUM_BLOCKS, BLOCK_SIZE)
    for i in range(batch):
        engine.add(f"r{i}", [1000 + 7 * i + j for j in range(64)], GREEDY)
    engine.step({rid: 64 for rid in engine.requests})
    schedule = {rid: 1 for rid in engine.requests}
    for _ in range(5):
        engine.step(schedule)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            engine.step(schedule)
        times.append((time.perf_counter() - started) / steps)
    for rid in list(engine.requests):
        engine.finish(rid)
    engine.step({})
    return times


def prefill_times(
    runner: ModelRunner, num_tokens: int, chunk: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds to prefill one ``num_tokens`` prompt in chunks of ``chunk`` tokens (the
    scheduler's token budget or ``--long-prefill-token-threshold``), one fresh request
    per repeat; and the seconds of each chunk of the last repeat."""
    times, chunk_times = [], []
    for r in range(repeats):
        engine = EngineSim(runner.execute, NUM_BLOCKS, BLOCK_SIZE, seed=r)
        engine.add("p", [1000 + (13 * j + r) % 30000 for j in range(num_tokens)], GREEDY)
        started = time.perf_counter()
        done = 0
        chunk_times = []
        while done < num_tokens:
            n = min(chunk, num_tokens - done)
            chunk_started = time.perf_counter()
            engine.step({"p": n})
            chunk_times.append(round(time.perf_counter() - chunk_started, 3))
            done += n
        times.append(time.perf_counter() - started)
        engine.finish("p")
        engine.step({})
    return times, chunk_times


def summary(name: str, times: list[float], per: float, unit: str) -> dict:
    return {
        "figure": name,
        "median_ms": round(statistics.median(times) * 1e3, 2),
        "min_ms": round(min(times) * 1e3, 2),
        "max_ms": round(max(times) * 1e3, 2),
        unit: round(per / statistics.median(times), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--eager", action="store_true", help="no compiled or native step")
    parser.add_argument("--no-native", action="store_true", help="no native decode step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None, Path(tempfile.gettempdir()) / "vtllm-bench-cache")
    quant = choose_quantization(
        args.quantization, False, load_hf_config(model_dir), fast_int4_cpu()
    )
    started = time.perf_counter()
    runner = ModelRunner.from_model_dir(
        model_dir, torch.device("cpu"), torch.float32, seed=0, cpu_quantization=quant
    )
    runner.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.dummy_run(BLOCK_SIZE)
    native = not args.eager and not args.no_native and runner.use_native_decode()
    compiled = not args.eager and runner.compile_cpu_steps(max(8, args.batch))
    print(
        json.dumps(
            {
                "quantization": quant,
                "threads": torch.get_num_threads(),
                "compiled_decode": compiled,
                "native_decode": native,
                "start_s": round(time.perf_counter() - started, 1),
            }
        ),
        flush=True,
    )
    for batch in (1, args.batch):
        times = decode_times(runner, batch, args.steps, args.repeats)
        print(json.dumps(summary(f"decode_batch_{batch}", times, batch, "tok_s")), flush=True)
    if args.prefill:
        times, chunk_times = prefill_times(runner, args.prefill, args.chunk, args.repeats)
        figure = summary(f"prefill_{args.prefill}", times, args.prefill, "tok_s")
        print(json.dumps({**figure, "chunk_s": chunk_times}), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        engine = EngineSim(runner.execute, NUM_BLOCKS, BLOCK_SIZE)
        engine.add("r", list(range(1000, 1064)), GREEDY)
        engine.step({"r": 64})
        for _ in range(3):
            engine.step({"r": 1})
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.step({"r": 1})
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
