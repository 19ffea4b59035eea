"""The event loop is never blocked by CPU work: templating and tokenizing large inputs run
on a worker thread (the tokenizer releases the GIL), and a prompt with more characters
than ``max_model_len`` tokens could hold is refused before it is tokenized."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.frontend.conftest import wait_until
from vtllm.frontend.openai_types import OpenAIError
from vtllm.frontend.sampling import check_prompt_chars

SENTENCE = "The quick brown fox jumps over the lazy dog. "  # ~10 tokens of the test tokenizer
MAX_MODEL_LEN = 131072
MAX_GAP_S = 0.5


async def test_a_stream_keeps_flowing_while_huge_prompts_are_handled(serve, tokenizer) -> None:
    served = await serve(text=SENTENCE * 40, max_model_len=MAX_MODEL_LEN)
    served.fake.token_interval_s = 0.02  # ~400 tokens: an 8 s stream
    long_prompt = SENTENCE * 10_500
    num_long_tokens = len(tokenizer.encode(long_prompt))
    assert num_long_tokens >= 100_000
    long_body = json.dumps({"prompt": long_prompt, "max_tokens": 5}).encode()
    huge_body = json.dumps({"prompt": "a" * (30 * 1024**2), "max_tokens": 5}).encode()
    headers = {"content-type": "application/json"}
    arrivals: list[float] = []

    async def stream() -> None:
        body = {"prompt": "Hi", "stream": True}
        async with served.http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())

    streaming = asyncio.create_task(stream())
    await wait_until(lambda: len(arrivals) >= 3)
    started = time.monotonic()
    long_reply, huge_reply = await asyncio.gather(
        served.http.post("/v1/completions", content=long_body, headers=headers, timeout=60),
        served.http.post("/v1/completions", content=huge_body, headers=headers, timeout=60),
    )
    ended = time.monotonic()
    streaming.cancel()
    await asyncio.gather(streaming, return_exceptions=True)

    assert long_reply.status_code == 200, long_reply.text
    assert long_reply.json()["usage"]["prompt_tokens"] == num_long_tokens
    assert huge_reply.status_code == 400, huge_reply.text
    error = huge_reply.json()["error"]
    assert error["param"] == "prompt" and "31457280 characters" in error["message"], error
    during = [t for t in arrivals if started <= t <= ended]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b >= started]
    assert len(during) >= 3, (len(during), ended - started)
    assert max(gaps) < MAX_GAP_S, f"the stream stalled {max(gaps):.3f}s"


async def test_an_oversized_prompt_is_refused_before_it_is_tokenized(serve, tokenizer) -> None:
    served = await serve(max_model_len=1024)
    limit = 1024 * tokenizer.max_chars_per_token
    start = time.monotonic()
    r = await served.http.post("/v1/completions", json={"prompt": "a" * (limit + 1)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert (
        f"{limit + 1} characters" in error["message"]
        and "max_model_len is 1024" in (error["message"])
    )
    assert time.monotonic() - start < 2
    # at the limit it is tokenized, and refused (or not) by its token count
    r = await served.http.post("/v1/completions", json={"prompt": "a" * limit})
    assert "characters" not in r.json()["error"]["message"]
    r = await served.http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a" * limit}]}]
            + [{"role": "user", "content": "b"}]
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_the_character_bound_is_a_proof() -> None:
    """No text of more than max_model_len × max_chars_per_token characters fits."""
    check_prompt_chars(1000, 10, 100)
    with pytest.raises(OpenAIError) as e:
        check_prompt_chars(1001, 10, 100, "messages")
    assert e.value.param == "messages" and "at least 101 tokens" in e.value.message


def test_max_chars_per_token_bounds_every_token(tokenizer) -> None:
    longest = max(
        len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)
    )
    assert longest <= tokenizer.max_chars_per_token
