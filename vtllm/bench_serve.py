"""``vtllm bench serve``: drive a running OpenAI-compatible server over HTTP and report
what its clients see, as one JSON object in the shape of ``vllm bench serve --save-result``
(``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...; here p50/p90/p99 always).

Workload: ``--num-prompts`` requests of random token ids (``/v1/completions``) or random
words (``/v1/chat/completions``), ``--input-len`` / ``--output-len`` each drawn uniformly
from ``[len·(1-r), len·(1+r)]`` (``--range-ratio r``, vLLM's ``--random-range-ratio``),
sent at ``--request-rate`` (Poisson arrivals; ``inf``: all at once) with at most
``--max-concurrency`` in flight, streaming by default, ``ignore_eos`` on request.

Per request (streaming)::

    sent ── first content chunk ── chunk ── chunk ── ... ── last chunk ── [DONE]
      |<-------- ttft -------->|<-itl->|<-itl->|                |
      |<------------------------------- e2el ------------------------------>|
    tpot = (e2el - ttft) / (output tokens - 1)

Output tokens come from the response's ``usage`` (``stream_options.include_usage``),
never from counting chunks (a chunk may carry several tokens, or none while the
detokenizer holds a partial character back).

The client must not be the bottleneck: it is a plain asyncio HTTP/1.1 client (one
keep-alive connection per concurrent stream, SSE parsed without per-chunk allocation of
anything but the event) in processes of its own (``--client-processes``), and the report
states the CPU it used per process (``client_cpu_fraction`` near 1 means the client, not
the server, set the pace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import msgspec

_WORD_LIST = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head"
)
_WORDS = _WORD_LIST.split()


@dataclass
class RequestSpec:
    prompt: list[int] | str  # token ids (completions) or text (chat)
    num_prompt_tokens: int
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    num_prompt_tokens: int
    num_output_tokens: int = 0
    sent: float = 0.0  # time.perf_counter(): comparable across processes (CLOCK_MONOTONIC)
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat (streaming)


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """The fields of a response or SSE event the benchmark reads (others are skipped)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    """The workload, from ``--seed``: the same flags give the same prompts."""
    rng = random.Random(args.seed)
    chat = args.endpoint.endswith("chat/completions")

    def length(mean: int) -> int:
        lo = max(1, int(mean * (1 - args.range_ratio)))
        return rng.randint(lo, max(lo, int(mean * (1 + args.range_ratio))))

    specs = []
    for _ in range(args.num_prompts):
        num_in, num_out = length(args.input_len), length(args.output_len)
        if chat:  # about one token per common word
            prompt: list[int] | str = " ".join(rng.choice(_WORDS) for _ in range(num_in))
        else:  # ids away from the ends, where special tokens usually live
            prompt = [rng.randrange(10, vocab_size - 10) for _ in range(num_in)]
        specs.append(RequestSpec(prompt, num_in, num_out))
    return specs


def request_body(args: argparse.Namespace, spec: RequestSpec) -> bytes:
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "stream": args.stream}
    if args.model:
        body["model"] = args.model
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    body["temperature"] = args.temperature
    return json.dumps(body).encode()


class HttpConnection:
    """One keep-alive HTTP/1.1 connection (plain http://), reopened after any failure."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20
            )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def post(self, path: str, body: bytes, result: RequestResult, stream: bool) -> None:
        """Send ``body`` and read the answer into ``result``; timings from ``result.sent``."""
        try:
            await self._open()
            assert self._reader is not None and self._writer is not None
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            result.sent = time.perf_counter()
            self._writer.write(head.encode() + body)
            status, headers = await self._read_head()
            if status != 200 or not stream:
                payload = await self._read_body(headers)
                if status != 200:
                    result.error = f"HTTP {status}: {payload[:300].decode(errors='replace')}"
                    return
                self._take_response(payload, result)
            else:
                await self._read_events(headers, result)
            if headers.get("connection") == "close":
                self.close()
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
            self.close()

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        assert self._reader is not None
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        return status, headers

    async def _chunks(self, headers: dict[str, str]):
        """The body's pieces as they arrive (chunked or Content-Length)."""
        assert self._reader is not None
        reader = self._reader
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b""):
                        pass  # trailers
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        else:
            yield await reader.readexactly(int(headers.get("content-length", "0")))

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        return b"".join([piece async for piece in self._chunks(headers)])

    def _take_response(self, payload: bytes, result: RequestResult) -> None:
        chunk = _decode_chunk(payload)
        now = time.perf_counter()
        result.e2el_s = result.ttft_s = now - result.sent
        result.num_output_tokens = chunk.usage.completion_tokens if chunk.usage else 0
        result.ok = chunk.error is None

    async def _read_events(self, headers: dict[str, str], result: RequestResult) -> None:
        buffer = b""
        last = 0.0
        done = False
        async for piece in self._chunks(headers):
            now = time.perf_counter()
            buffer += piece
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2 :]
                if not event.startswith(b"data: "):
                    continue  # a keepalive comment
                data = event[6:]
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = _decode_chunk(data)
                if chunk.error is not None:
                    result.error = str(chunk.error)[:300]
                if chunk.usage is not None:
                    result.num_output_tokens = chunk.usage.completion_tokens
                if any(c.text or (c.delta and c.delta.content) for c in chunk.choices):
                    if last == 0.0:
                        result.ttft_s = now - result.sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.e2el_s = time.perf_counter() - result.sent
        if not done and not result.error:
            result.error = "stream ended without [DONE]"
        result.ok = not result.error


async def run_client(
    args: argparse.Namespace, specs: list[RequestSpec], max_concurrency: int, rate: float
) -> tuple[list[RequestResult], float, float, float]:
    """Send ``specs``; returns (results, first send, last finish, CPU seconds used)."""
    url = urllib.parse.urlsplit(args.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    bodies = [request_body(args, spec) for spec in specs]
    queue: asyncio.Queue[int | None] = asyncio.Queue()
    results = [RequestResult(False, spec.num_prompt_tokens) for spec in specs]
    rng = random.Random(args.seed + 1)

    async def arrivals() -> None:
        for i in range(len(specs)):
            queue.put_nowait(i)
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        for _ in range(max_concurrency):
            queue.put_nowait(None)

    async def stream_slot() -> None:
        connection = HttpConnection(host, port)
        try:
            while (i := await queue.get()) is not None:
                await connection.post(args.endpoint, bodies[i], results[i], args.stream)
        finally:
            connection.close()

    cpu_started = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(arrivals(), *(stream_slot() for _ in range(max_concurrency)))
    finished = time.perf_counter()
    return results, started, finished, time.process_time() - cpu_started


def _client_process(args: argparse.Namespace, specs, max_concurrency: int, rate: float):
    return asyncio.run(run_client(args, specs, max_concurrency, rate))


def _percentiles(name: str, values_s: list[float], unit_ms: bool = True) -> dict[str, float]:
    scale = 1000.0 if unit_ms else 1.0
    suffix = "_ms" if unit_ms else ""
    values = sorted(values_s)
    out: dict[str, float] = {}
    if not values:
        values = [0.0]
    out[f"mean_{name}{suffix}"] = round(sum(values) / len(values) * scale, 3)
    for p in (50, 90, 99):
        idx = min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))
        key = f"median_{name}{suffix}" if p == 50 else f"p{p}_{name}{suffix}"
        out[key] = round(values[idx] * scale, 3)
    return out


def summarize(
    results: list[RequestResult], duration_s: float, args: argparse.Namespace
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    num_in = sum(r.num_prompt_tokens for r in ok)
    num_out = sum(r.num_output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    report: dict[str, Any] = {
        "endpoint": args.endpoint,
        "stream": args.stream,
        "num_prompts": len(results),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "duration": round(duration_s, 3),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_throughput": round(num_out / duration_s, 1),
        "total_token_throughput": round((num_in + num_out) / duration_s, 1),
    }
    tpots = [
        (r.e2el_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1
    ]
    report.update(_percentiles("ttft", [r.ttft_s for r in ok]))
    report.update(_percentiles("tpot", tpots))
    report.update(_percentiles("itl", [x for r in ok for x in r.itl_s]))
    report.update(_percentiles("e2el", [r.e2el_s for r in ok]))
    return report


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    specs = make_requests(args, args.vocab_size)
    concurrency = args.max_concurrency or len(specs)
    num_procs = max(1, min(args.client_processes, concurrency))
    if args.warmup:  # one short request: connections, first-call costs on the server
        asyncio.run(run_client(args, [RequestSpec(specs[0].prompt, 0, 4)], 1, math.inf))
    shares = [specs[i::num_procs] for i in range(num_procs)]
    slots = [concurrency // num_procs + (i < concurrency % num_procs) for i in range(num_procs)]
    rate = args.request_rate / num_procs
    if num_procs == 1:
        parts = [asyncio.run(run_client(args, specs, concurrency, rate))]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(num_procs) as pool:
            parts = pool.starmap(
                _client_process,
                [(args, share, slot, rate) for share, slot in zip(shares, slots, strict=True)],
            )
    results = [r for part in parts for r in part[0]]
    duration = max(p[2] for p in parts) - min(p[1] for p in parts)
    report = summarize(results, duration, args)
    report["client_processes"] = num_procs
    report["client_cpu_fraction"] = round(max(p[3] / (p[2] - p[1]) for p in parts), 3)
    return report


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=("/v1/completions", "/v1/chat/completions"),
        help="completions (random token-id prompts) or chat (random-word prompts)",
    )
    parser.add_argument("--model", default=None, help="the model field of each request")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests to send")
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="mean max_tokens")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (0: fixed lengths)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate max_tokens whatever is sampled"
    )
    parser.add_argument(
        "--no-stream", dest="stream", action="store_false", help="non-streaming requests"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--vocab-size", type=int, default=32000, help="random prompt ids are below this"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes sharing the streams (raise it when client_cpu_fraction ~ 1)",
    )
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--seed", type=int, default=0)


def run_bench_serve(args: argparse.Namespace) -> int:
    print(json.dumps(bench_serve(args)), flush=True)
    return 0
