"""The OpenAI request surface through a real `vtllm serve` and the real `openai` SDK."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import QUESTION
from tests.e2e.server import engine_utility

pytestmark = pytest.mark.slow

# over two 16-token blocks, so an identical second request hits the prefix cache
LONG_PROMPT = "Count slowly and carefully from one to twenty, writing every number out in full words: one, two,"


def test_async_client_streams(server, model):
    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120)
        kwargs = dict(model=model, messages=QUESTION, temperature=0, max_tokens=12)
        full = (await aclient.chat.completions.create(**kwargs)).choices[0].message.content
        parts = []
        async for chunk in await aclient.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        await aclient.close()
        return full, "".join(parts)

    full, streamed = asyncio.run(run())
    assert full and streamed == full


def test_stream_usage_chunk(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_n2_with_seed_distinct_and_reproducible(client, model):
    """Seeded choices differ from each other, and a seeded request repeats when it runs
    the same way again (the same prefix-cache state, alone on the server).

    Not promised when what shares its steps changes: prompt tokens prefilled beside
    another request's differ in the last bits, which the int4 decode's int8 activations
    can turn into another sample at temperature 1 (``docs/USAGE.md``, "Seeds"). The two
    choices of ``n=2`` arrive as two messages, sometimes one step apart, so the test
    repeats one-choice requests."""
    kwargs = dict(model=model, messages=QUESTION, temperature=1.0, max_tokens=16, seed=1234)
    both = [c.message.content for c in client.chat.completions.create(n=2, **kwargs).choices]
    assert len(both) == 2 and both[0] != both[1]
    repeats = [client.chat.completions.create(**kwargs).choices[0].message.content for _ in "abc"]
    assert repeats[0] == repeats[1] == repeats[2]


def test_stop_string_cut_across_tokens(client, model):
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[1][1:] + " " + words[2][:2]  # starts mid-word, spans a space: several tokens
    cut = text[: text.index(stop)]
    reply = client.completions.create(stop=[stop], **kwargs)
    assert reply.choices[0].text == cut
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kwargs)
    )
    assert streamed == cut


def test_completion_prompts_as_strings_and_token_ids(client, model):
    reply = client.completions.create(
        model=model, prompt=["Hello, my name is", "The sky is"], max_tokens=4, temperature=0
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    tokens = httpx.post(
        f"{client.base_url}".replace("/v1/", "") + "/tokenize",
        json={"prompt": "The sky is"},
    ).json()["tokens"]
    by_ids = client.completions.create(model=model, prompt=tokens, max_tokens=4, temperature=0)
    # the same prompt as a string, alone like the ids (int4 CPU decode is not
    # batch-invariant: one row and two rows may take different kernel paths)
    alone = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == alone.choices[0].text


def test_echo_and_logprobs_shapes(client, model):
    reply = client.completions.create(
        model=model, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = reply.choices[0]
    assert choice.text.startswith("The sky is")
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs if t)
    chat = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content)


def test_error_shapes(server, model):
    url = server.url
    bad_type = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": QUESTION, "temperature": "hot"}
    )
    assert bad_type.status_code == 400 and "temperature" in bad_type.json()["error"]["message"]
    bad_json = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400
    unknown = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    huge = httpx.post(f"{url}/v1/completions", content=b"x" * (33 * 1024 * 1024))
    assert huge.status_code == 413


def test_metrics_move_by_the_right_amounts(server, client, model):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics").text
        values = {}
        for line in text.splitlines():
            match = re.match(r"^(vtllm:[a-z0-9_]+)(\{[^}]*\})? (\S+)$", line)
            if match:
                labels = match.group(2) or ""
                reason = re.search(r'finished_reason="(\w+)"', labels)
                key = match.group(1) + (f"[{reason.group(1)}]" if reason else "")
                values[key] = values.get(key, 0.0) + float(match.group(3))
        return values

    before = scrape()
    for _ in range(2):
        client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=5, temperature=0)
    after = scrape()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vtllm:request_success_total[length]") == 2
    assert delta("vtllm:generation_tokens_total") == 10
    assert delta("vtllm:prompt_tokens_total") > 0
    assert delta("vtllm:e2e_request_latency_seconds_count") == 2
    assert delta("vtllm:time_to_first_token_seconds_count") == 2
    assert delta("vtllm:request_generation_tokens_count") == 2
    assert delta("vtllm:request_queue_time_seconds_count") == 2
    assert delta("vtllm:request_prefill_time_seconds_count") == 2
    assert delta("vtllm:inter_token_latency_seconds_count") == 8
    assert delta("vtllm:prefix_cache_queries_total") > 0
    assert delta("vtllm:prefix_cache_hits_total") > 0  # the second request hit the first's blocks


def test_client_disconnect_aborts_and_frees_blocks(server, model):
    body = {
        "model": model,
        "prompt": "Write a long essay about rivers.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break  # leave mid-stream: closing the connection is the disconnect
    deadline = time.monotonic() + 15
    stats = engine_utility(server, "get_stats")
    while time.monotonic() < deadline and stats["num_running"]:
        time.sleep(0.2)
        stats = engine_utility(server, "get_stats")
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_logit_bias_and_penalties_reach_the_model(server, client, model):
    token = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana"}).json()["tokens"][-1]
    forced = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": forced.choices[0].text}).json()
    assert set(ids["tokens"]) == {token}, forced.choices[0].text
    plain = client.completions.create(
        model=model, prompt="One, one, one,", max_tokens=8, temperature=0
    )
    penalised = client.completions.create(
        model=model, prompt="One, one, one,", max_tokens=8, temperature=0, frequency_penalty=2.0
    )
    assert penalised.choices[0].text != plain.choices[0].text
