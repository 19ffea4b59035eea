"""Serving figures for a real `vtllm serve`: time to healthy (first run with an empty
cache, then cached), single-stream decode tok/s, aggregate tok/s and time to first token at
N concurrent streams, prefill tok/s of long prompts, and in the same run the `transformers`
baseline on the same converted model.

    .venv/bin/python benchmarks/serve_smoke.py [--concurrency 8] [--output-tokens 128] \
        [--prefill-tokens 1024,2048,8000] [--baseline-prefill-tokens 1024,2048] \
        [-- extra vtllm serve flags]

Prints one JSON object. Decode tok/s counts streamed tokens after the first one over the
time between first and last token, so prefill is excluded; aggregate tok/s is all output
tokens of the concurrent streams over the wall time of the whole batch; TTFT p50/p99 are
over those streams. Prefill tok/s: a completion of 1 token for a prompt of N random token
ids (a fresh prompt each, so no prefix-cache hit), N over its time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.server import ServerProcess  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


async def stream_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, float]:
    """(tokens streamed, seconds from first to last token)."""
    body = {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    return len(times), (times[-1] - times[0]) if len(times) > 1 else 0.0


async def stream_ttft(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, float]:
    """(tokens streamed, seconds from the request to its first token)."""
    body = {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first, count = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                count += 1
    return count, (first or time.perf_counter()) - started


def random_prompt(num_tokens: int, seed: int) -> list[int]:
    """Token ids of ordinary vocabulary entries (no specials), different for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(num_tokens)]


async def measure_prefill(client: httpx.AsyncClient, url: str, num_tokens: int) -> float:
    body = {"prompt": random_prompt(num_tokens, num_tokens), "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return num_tokens / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def complete_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> int:
    body = {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


async def measure(
    url: str, concurrency: int, output_tokens: int, prefill_tokens: list[int]
) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await complete_one(client, url, 8)  # warm-up
        n, seconds = await stream_one(client, url, output_tokens)
        single = (n - 1) / seconds if seconds else 0.0
        started = time.perf_counter()
        streams = await asyncio.gather(
            *[stream_ttft(client, url, output_tokens) for _ in range(concurrency)]
        )
        wall = time.perf_counter() - started
        prefill = {
            f"prefill_tok_s_at_{num_tokens}": round(
                await measure_prefill(client, url, num_tokens), 1
            )
            for num_tokens in prefill_tokens
        }
    counts = [count for count, _ in streams]
    ttfts = [ttft for _, ttft in streams]
    return {
        "single_stream_decode_tok_s": round(single, 2),
        f"aggregate_tok_s_at_{concurrency}": round(sum(counts) / wall, 2),
        "concurrent_output_tokens": sum(counts),
        "concurrent_wall_s": round(wall, 2),
        f"ttft_p50_s_at_{concurrency}": round(percentile(ttfts, 0.5), 3),
        f"ttft_p99_s_at_{concurrency}": round(percentile(ttfts, 0.99), 3),
        **prefill,
    }


def transformers_baseline(
    model_dir: Path, concurrency: int, output_tokens: int, prefill_tokens: list[int]
) -> dict:
    """`transformers` generate on the same converted model, dtype and device (CPU, fp32):
    batch-1 decode tok/s (prefill subtracted), batch-N aggregate tok/s, and prefill tok/s
    (one forward over each prompt length, the same random ids as vtllm's)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids

    def run(batch: torch.Tensor, new_tokens: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        return time.perf_counter() - started

    run(ids, 4)  # warm-up
    prefill = run(ids, 1)
    single = (output_tokens - 1) / (run(ids, output_tokens) - prefill)
    batch = ids.repeat(concurrency, 1)
    aggregate = concurrency * output_tokens / run(batch, output_tokens)
    prefill = {}
    for num_tokens in prefill_tokens:
        prompt = torch.tensor([random_prompt(num_tokens, num_tokens)])
        started = time.perf_counter()
        with torch.inference_mode():
            model(prompt)
        prefill[f"transformers_prefill_tok_s_at_{num_tokens}"] = round(
            num_tokens / (time.perf_counter() - started), 1
        )
    return {
        "transformers_single_stream_decode_tok_s": round(single, 2),
        f"transformers_aggregate_tok_s_at_{concurrency}": round(aggregate, 2),
        **prefill,
        "transformers": transformers.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", default="1024,2048,8000")
    parser.add_argument("--baseline-prefill-tokens", default="1024,2048")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("serve_args", nargs="*", help="extra `vtllm serve` flags (after --)")
    args = parser.parse_args()
    prefill_tokens = [int(n) for n in args.prefill_tokens.split(",") if n]
    baseline_prefill = [int(n) for n in args.baseline_prefill_tokens.split(",") if n]

    cache_dir = Path(tempfile.mkdtemp(prefix="vtllm-bench-cache-"))
    results: dict = {}
    for label in ("first_run", "cached"):
        server = ServerProcess(*args.serve_args, cache_dir=cache_dir).start()
        try:
            results[f"time_to_healthy_s_{label}"] = round(server.wait_healthy(600), 2)
            if label == "cached":
                results.update(
                    asyncio.run(
                        measure(server.url, args.concurrency, args.output_tokens, prefill_tokens)
                    )
                )
        finally:
            server.stop()
    model_dir = next((cache_dir / "models").iterdir())
    if not args.skip_baseline:
        results.update(
            transformers_baseline(model_dir, args.concurrency, args.output_tokens, baseline_prefill)
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
