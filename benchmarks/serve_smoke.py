"""Serving figures for a real `vtllm serve`: time to healthy (first run with an empty
cache, then cached), single-stream decode tok/s, aggregate tok/s at N concurrent streams,
and in the same run the `transformers` generate baseline on the same converted model.

    .venv/bin/python benchmarks/serve_smoke.py [--concurrency 8] [--output-tokens 128] \
        [-- extra vtllm serve flags]

Prints one JSON object. Decode tok/s counts streamed tokens after the first one over the
time between first and last token, so prefill is excluded; aggregate tok/s is all output
tokens of the concurrent requests over the wall time of the whole batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def measure(url: str, concurrency: int, output_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await complete_one(client, url, 8)  # warm-up
        n, seconds = await stream_one(client, url, output_tokens)
        single = (n - 1) / seconds if seconds else 0.0
        started = time.perf_counter()
        counts = await asyncio.gather(
            *[complete_one(client, url, output_tokens) for _ in range(concurrency)]
        )
        wall = time.perf_counter() - started
    return {
        "single_stream_decode_tok_s": round(single, 2),
        f"aggregate_tok_s_at_{concurrency}": round(sum(counts) / wall, 2),
        "concurrent_output_tokens": sum(counts),
        "concurrent_wall_s": round(wall, 2),
    }


def transformers_baseline(model_dir: Path, concurrency: int, output_tokens: int) -> dict:
    """`transformers` generate on the same converted model, dtype and device (CPU, fp32):
    batch-1 decode tok/s (prefill subtracted) and batch-N aggregate tok/s."""
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
    return {
        "transformers_single_stream_decode_tok_s": round(single, 2),
        f"transformers_aggregate_tok_s_at_{concurrency}": round(aggregate, 2),
        "transformers": transformers.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("serve_args", nargs="*", help="extra `vtllm serve` flags (after --)")
    args = parser.parse_args()

    cache_dir = Path(tempfile.mkdtemp(prefix="vtllm-bench-cache-"))
    results: dict = {}
    for label in ("first_run", "cached"):
        server = ServerProcess(*args.serve_args, cache_dir=cache_dir).start()
        try:
            results[f"time_to_healthy_s_{label}"] = round(server.wait_healthy(600), 2)
            if label == "cached":
                results.update(
                    asyncio.run(measure(server.url, args.concurrency, args.output_tokens))
                )
        finally:
            server.stop()
    model_dir = next((cache_dir / "models").iterdir())
    results.update(transformers_baseline(model_dir, args.concurrency, args.output_tokens))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
