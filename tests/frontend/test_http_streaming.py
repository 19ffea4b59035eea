"""SSE streaming, keepalives, client disconnect and engine death over real HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.frontend.conftest import parse_sse, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"messages": [{"role": "user", "content": "Hello"}]}


async def test_chat_stream_format(serve) -> None:
    served = await serve(text="Hello world! 你好 🙂 The end.")
    r = await served.http.post(
        CHAT, json={**USER, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    payloads = parse_sse(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(served.fake.token_ids)
    content_chunks = chunks[1:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    assert text == "Hello world! 你好 🙂 The end." and "\ufffd" not in r.text
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks[:-1])


async def test_completion_stream_stop_string_and_no_usage(serve) -> None:
    served = await serve(text="Hello world! The end.")
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "stream": True, "stop": "ld! T"})
    chunks = [json.loads(p) for p in parse_sse(r.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello wor"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)
    # the stop string ended the request early: the engine request was aborted
    await wait_until(lambda: len(served.fake.aborted_snapshot()) == 1)


async def test_keepalive_while_waiting_for_first_token(serve, monkeypatch) -> None:
    monkeypatch.setenv("VT_SSE_KEEPALIVE_S", "0.05")
    served = await serve(text="Hello")
    served.fake.first_token_delay_s = 0.4
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert first_data >= 2 and all(e == ": keepalive" for e in events[:first_data])
    assert events[-1] == "data: [DONE]"


def _carries_text(event: str) -> bool:
    if not event.startswith("data: {"):
        return False
    choices = json.loads(event[len("data: ") :])["choices"]
    return bool(choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_keepalive_whenever_a_stream_is_silent(serve, monkeypatch, path: str) -> None:
    """A stream that stalls after its first token (a slow step, recompute after
    preemption) still sends keepalives between its tokens, on both endpoints."""
    monkeypatch.setenv("VT_SSE_KEEPALIVE_S", "0.05")
    served = await serve(text="Hello world! The end.")
    served.fake.token_interval_s = 0.3
    body = {**USER, "stream": True} if path == CHAT else {"prompt": "Hi", "stream": True}
    r = await served.http.post(path, json=body)
    events = [e for e in r.text.split("\n\n") if e]
    text_events = [i for i, e in enumerate(events) if _carries_text(e)]
    assert len(text_events) >= 3, r.text
    # between the first and the second token (0.3 s apart) the stream was not silent
    between = events[text_events[0] + 1 : text_events[1]]
    assert len(between) >= 2 and all(e == ": keepalive" for e in between), events
    assert events[-1] == "data: [DONE]"


async def test_keepalive_off(serve, monkeypatch) -> None:
    monkeypatch.setenv("VT_SSE_KEEPALIVE_S", "0")
    served = await serve(text="Hello")
    served.fake.first_token_delay_s = 0.2
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "stream": True})
    assert ": keepalive" not in r.text


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts(serve, stream: bool) -> None:
    served = await serve(text="Hello world! The end. " * 10)
    served.fake.token_interval_s = 0.1
    body = {**USER, "stream": stream}

    async def request() -> None:
        async with served.http.stream("POST", CHAT, json=body) as r:
            async for _ in r.aiter_bytes():
                pass

    task = asyncio.create_task(request())
    await wait_until(lambda: len(served.fake.added) == 1)
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: served.fake.aborted_snapshot() == [served.fake.added[0].request_id])
    await wait_until(lambda: served.engine.num_in_flight == 0)


async def test_engine_silence_gives_503(serve, monkeypatch) -> None:
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", "0.5")
    served = await serve()
    assert (await served.http.get("/health")).status_code == 200
    served.fake.silent = True
    await wait_until(lambda: not served.engine.is_alive, timeout_s=5)
    r = await served.http.get("/health")
    assert r.status_code == 503 and "silent" in r.json()["error"]["message"]
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert served.dead_reasons


async def test_engine_dead_mid_stream_sends_error_event(serve) -> None:
    served = await serve(text="Hello world! The end.")
    served.fake.first_token_delay_s = 30

    async def kill_soon() -> None:
        await wait_until(lambda: len(served.fake.added) == 1)
        served.fake.send_dead("GPU fell off the bus")

    killer = asyncio.create_task(kill_soon())
    r = await served.http.post(CHAT, json={**USER, "stream": True})
    await killer
    payloads = parse_sse(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert "GPU fell off the bus" in error["message"] and set(error) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert (await served.http.get("/health")).status_code == 503
    r = await served.http.post(CHAT, json={**USER, "stream": True})
    assert r.status_code == 503


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_an_engine_refusal_is_a_400_naming_the_field(serve, path: str) -> None:
    """The engine core's own guard refuses what the frontend let through (its limit changed
    since the handshake): the client gets a 400 naming the field, never a 500."""
    served = await serve()
    served.fake.guard_max_model_len = 4
    body = {**USER} if path == CHAT else {"prompt": "Hello world! The quick brown fox."}
    r = await served.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in ("messages", "prompt")
    assert "max_model_len is 4" in error["message"]
    r = await served.http.post(path, json={**body, "stream": True})
    payloads = parse_sse(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "invalid_request_error" and "max_model_len is 4" in error["message"]
    assert error["param"] == "prompt"


async def test_an_engine_that_cannot_serve_now_is_a_503(serve) -> None:
    served = await serve()
    served.fake.unavailable = "the engine core is shutting down"
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi"})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
