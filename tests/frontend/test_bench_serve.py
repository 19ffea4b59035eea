"""``vtllm bench serve``'s client against a real frontend (FakeEngine behind it): the
counts and timings it reports come from what the server streamed."""

from __future__ import annotations

import argparse

from vtllm.bench_serve import add_serve_arguments, make_requests, run_client, summarize


def _args(url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--base-url", url, "--vocab-size", "300", *extra])


async def test_streamed_tokens_and_timings_are_counted(serve, tokenizer) -> None:
    served = await serve(text="Hello world! The end.")
    num_tokens = len(tokenizer.encode("Hello world! The end.", add_special_tokens=False))
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        args = _args(served.base_url, "--num-prompts", "6", "--max-concurrency", "3",
                     "--input-len", "8", "--endpoint", endpoint)  # fmt: skip
        specs = make_requests(args, args.vocab_size)
        results, started, finished, cpu_s = await run_client(args, specs, 3, float("inf"))
        report = summarize(results, finished - started, args)
        assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
        # usage, not chunk counts: the fake engine sends its tokens whatever max_tokens says
        assert report["total_output_tokens"] == 6 * num_tokens
        assert report["total_input_tokens"] == 6 * 8
        assert 0 < report["median_ttft_ms"] <= report["median_e2el_ms"]
        assert all(len(r.itl_s) >= 1 for r in results)  # several content chunks each
        assert cpu_s > 0


async def test_failures_are_counted_with_their_reason(serve) -> None:
    served = await serve()
    args = _args(served.base_url, "--num-prompts", "2", "--model", "no-such-model")
    results, started, finished, _ = await run_client(
        args, make_requests(args, args.vocab_size), 2, float("inf")
    )
    report = summarize(results, finished - started, args)
    assert report["failed"] == 2 and report["completed"] == 0
    [(reason, count)] = report["errors"].items()
    assert count == 2 and reason.startswith("HTTP 404")
