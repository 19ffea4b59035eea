"""Long prefills share the step: time to first token of short requests sent while a long
prompt is being prefilled, with ``--long-prefill-token-threshold`` on and off, through a
real ``vtllm serve`` (embedded SmolLM2 on CPU unless told otherwise).

    .venv/bin/python benchmarks/long_prefill_ttft.py [--prompt-tokens 6000] \
        [--thresholds 512,0,512] [-- extra vtllm serve flags]

For each threshold in turn (0 = off, the old behaviour and the baseline of the same run;
repeat values to interleave them on a noisy machine) one server is started and measures,
over HTTP (streamed chat completions, temperature 0):

- ``lone``: the long request alone — TTFT and total time (``--output-tokens`` tokens);
- ``shared``: the same-length long request (a different prompt: no prefix-cache hit) while
  one-token requests are sent one after another (``--short-gap-s`` apart, the first
  ``--short-delay-s`` after the long one) until the long one's first token arrives —
  the long request's TTFT and total, and every short request's TTFT.

Each run also lists the server's own prefill progress lines (tokens done, seconds since
the first chunk) for both long requests. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.server import ServerProcess  # noqa: E402

WORDS = [
    "harbor",
    "lantern",
    "keeper",
    "tide",
    "signal",
    "rope",
    "gull",
    "storm",
    "beacon",
    "ledger",
    "cliff",
    "salt",
    "island",
    "supply",
    "chart",
    "compass",
    "morning",
    "evening",
    "fog",
    "bell",
    "stair",
    "window",
    "glass",
    "oil",
]


def system_text(num_sentences: int, nonce: str) -> str:
    """Deterministic filler; ``nonce`` first, so no two prompts share a cached block."""
    sentences = [f"Log {nonce}."]
    for i in range(num_sentences):
        a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 7) % len(WORDS)], WORDS[(i * 13) % 23]
        sentences.append(f"Entry {i}: the {a} and the {b} were checked near the {c}.")
    return " ".join(sentences)


def messages(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def count_tokens(client: httpx.AsyncClient, url: str, msgs: list[dict]) -> int:
    response = await client.post(f"{url}/tokenize", json={"messages": msgs})
    response.raise_for_status()
    return response.json()["count"]


async def long_messages(
    client: httpx.AsyncClient, url: str, target: int, nonce: str
) -> tuple[list[dict], int]:
    """A conversation of about ``target`` tokens (system prompt + short question)."""
    num = max(1, target // 16)
    for _ in range(3):  # proportional correction converges in one or two rounds
        msgs = messages(system_text(num, nonce), "Summarise the log in one sentence.")
        count = await count_tokens(client, url, msgs)
        if abs(count - target) <= target // 100:
            break
        num = max(1, round(num * target / count))
    return msgs, count


async def stream_chat(
    client: httpx.AsyncClient, url: str, msgs: list[dict], max_tokens: int
) -> dict:
    """Seconds from sending to the first content token and to the end."""
    body = {
        "messages": msgs,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            choices = chunk.get("choices") or []
            # the first chunk only announces the role (empty content): not a token
            if (
                first is None
                and choices
                and (choices[0]["delta"].get("content") or choices[0].get("finish_reason"))
            ):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": round((first or end) - started, 3), "total_s": round(end - started, 3)}


async def measure(url: str, args: argparse.Namespace, label: str) -> dict:
    async with httpx.AsyncClient(timeout=900) as client:
        await stream_chat(client, url, messages("Be brief.", "Hi"), 2)  # warm-up
        lone_msgs, lone_count = await long_messages(client, url, args.prompt_tokens, f"{label}-a")
        lone = await stream_chat(client, url, lone_msgs, args.output_tokens)

        shared_msgs, shared_count = await long_messages(
            client, url, args.prompt_tokens, f"{label}-b"
        )
        long_task = asyncio.create_task(stream_chat(client, url, shared_msgs, args.output_tokens))
        long_started = time.perf_counter()
        await asyncio.sleep(args.short_delay_s)
        shorts = []
        while not long_task.done():
            sent_at = time.perf_counter() - long_started
            result = await stream_chat(client, url, messages("Be brief.", f"Hi {len(shorts)}"), 1)
            shorts.append({"sent_at_s": round(sent_at, 2), "ttft_s": result["ttft_s"]})
            await asyncio.sleep(args.short_gap_s)
        shared = await long_task
    ttfts = [s["ttft_s"] for s in shorts]
    return {
        "lone_long": {"prompt_tokens": lone_count, **lone},
        "shared_long": {"prompt_tokens": shared_count, **shared},
        "short_requests": shorts,
        "short_ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "short_ttft_max_s": max(ttfts) if ttfts else None,
    }


def prefill_progress(log: str) -> list[list[float]]:
    """(tokens done, elapsed seconds) from the engine's ``prefill running/done`` lines."""
    pattern = r"prefill (?:running|done): request=\S+ tokens=(\d+)/\d+ elapsed_s=([\d.]+)"
    return [[int(n), float(t)] for n, t in re.findall(pattern, log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--thresholds", default="512,0,512", help="comma-separated; 0 = off")
    parser.add_argument("--short-delay-s", type=float, default=1.0)
    parser.add_argument("--short-gap-s", type=float, default=0.5)
    parser.add_argument("serve_args", nargs="*", help="extra `vtllm serve` flags (after --)")
    args = parser.parse_args()

    cache_dir = Path(tempfile.mkdtemp(prefix="vtllm-bench-cache-"))
    results: dict = {"prompt_tokens_target": args.prompt_tokens, "runs": []}
    for i, threshold in enumerate(int(t) for t in args.thresholds.split(",")):
        server = ServerProcess(
            "--long-prefill-token-threshold", str(threshold), *args.serve_args, cache_dir=cache_dir
        ).start()
        try:
            server.wait_healthy(600)
            run = {"threshold": threshold, "started": time.strftime("%H:%M:%S")}
            run.update(asyncio.run(measure(server.url, args, f"{i}-{threshold}")))
            run["prefill_progress"] = prefill_progress(server.log())
        finally:
            server.stop()
        results["runs"].append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
