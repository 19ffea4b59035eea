"""Hostile HTTP clients against the real app over a real socket (FakeEngine behind it):
every mistake is a 4xx in OpenAI shape and the kept-alive connection serves the next
request; bounded work per request; no redirects; clipped echoes; Bearer in any case; slow
senders timed out."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import msgspec
import pytest

from tests.frontend.raw_http import RawConnection, Reply, dribble, parse_raw_reply
from vtllm.config import VtllmConfig
from vtllm.frontend import openai_types
from vtllm.frontend.response_types import ErrorResponse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
GOOD_COMPLETION = {"prompt": "Hello", "max_tokens": 3}
DEEP = 100_000


def _port(served) -> int:
    return int(served.base_url.rsplit(":", 1)[1])


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _error(reply: Reply, status: int) -> dict:
    """The error of ``reply``, which must have ``status`` and OpenAI's error shape."""
    assert reply.status == status, (reply.status, reply.body[:500])
    msgspec.json.decode(reply.body, type=ErrorResponse)  # exactly {message, type, param, code}
    return reply.json()["error"]


def _bad_then_good(port: int, path: str, bad: bytes, good: dict, status: int = 400) -> dict:
    """Send ``bad`` then ``good`` on one kept-alive connection: the first is refused with
    ``status`` (OpenAI shape), the second succeeds on the same socket."""
    with RawConnection(port) as conn:
        error = _error(conn.request("POST", path, bad), status)
        assert conn.reusable, "the server closed the connection after a client mistake"
        ok = conn.request("POST", path, good)
        assert ok.status == 200, ok.body[:500]
    return error


def _body(prefix: str, nested: str, suffix: str = "}") -> bytes:
    return (prefix + nested + suffix).encode()


DEEP_BODIES = {
    "tools": (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"a": ', "}]}"),
    "chat_template_kwargs": (
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": ',
        "}}",
    ),
    "response_format": (
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"a": ',
        "}}",
    ),
    "tool_calls": (
        CHAT,
        '{"messages": [{"role": "assistant", "tool_calls": [{"a": ',
        '}]}, {"role": "user", "content": "hi"}]}',
    ),
    "unknown field": (COMPLETIONS, '{"prompt": "hi", "zzz": ', "}"),
    "tokenize": ("/tokenize", '{"prompt": "hi", "zzz": ', "}"),
    "tokenize chat": (
        "/tokenize",
        '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"a": ',
        "}]}",
    ),
}
GOOD = {CHAT: GOOD_CHAT, COMPLETIONS: GOOD_COMPLETION, "/tokenize": {"prompt": "hi"}}


async def test_deep_nesting_is_400_and_connection_survives(serve) -> None:
    served = await serve()
    for where, (path, prefix, suffix) in DEEP_BODIES.items():
        bad = _body(prefix, _nested(DEEP), suffix)
        error = await asyncio.to_thread(_bad_then_good, _port(served), path, bad, GOOD[path])
        assert error["code"] == "json_too_deep", where
        assert (
            "deeper than 64 levels" in error["message"] and "--max-json-depth" in error["message"]
        )


async def test_depth_limit_is_exact_and_configurable(serve) -> None:
    config = VtllmConfig()
    config.frontend.max_json_depth = 10
    served = await serve(config=config)
    # the body object is level 1, chat_template_kwargs' object level 2, then 8 arrays
    inside = {"a": json.loads(_nested(8))}
    ok = await served.http.post(CHAT, json={**GOOD_CHAT, "chat_template_kwargs": inside})
    assert ok.status_code == 200, ok.text
    inside = {"a": json.loads(_nested(9))}
    r = await served.http.post(CHAT, json={**GOOD_CHAT, "chat_template_kwargs": inside})
    assert (
        r.status_code == 400 and "deeper than 10 levels (11 seen)" in r.json()["error"]["message"]
    )
    # brackets inside strings are text, not nesting
    ok = await served.http.post(COMPLETIONS, json={**GOOD_COMPLETION, "prompt": "[{" * 50})
    assert ok.status_code == 200, ok.text


INVALID_UTF8 = {
    "unknown key": b'{"prompt": "hi", "z\xff\xfe": 1}',
    "unknown value": b'{"prompt": "hi", "z": "\xc3\x28"}',
    "known value": b'{"prompt": "hi \xed\xa0\x80"}',
    "model": b'{"prompt": "hi", "model": "\x80"}',
}


async def test_invalid_utf8_is_400_and_connection_survives(serve) -> None:
    served = await serve()
    for where, bad in INVALID_UTF8.items():
        error = await asyncio.to_thread(
            _bad_then_good, _port(served), COMPLETIONS, bad, GOOD_COMPLETION
        )
        assert "not valid UTF-8" in error["message"], where


async def test_too_many_unknown_fields_is_400(serve) -> None:
    served = await serve()
    body = {**GOOD_COMPLETION, **{f"x{i}": i for i in range(100)}}
    r = await served.http.post(COMPLETIONS, json=body)
    assert r.status_code == 400
    assert "100 fields CompletionRequest does not know" in r.json()["error"]["message"]
    assert served.fake.added == []
    ok = await served.http.post(COMPLETIONS, json={**GOOD_COMPLETION, "x1": 1, "x2": 2})
    assert ok.status_code == 200


async def test_unknown_field_log_stays_bounded(serve, caplog, monkeypatch) -> None:
    """Many requests, each with 60 fresh 1 kB unknown names: a few log lines, and the
    log's memory holds at most its ``remember`` names."""
    log = openai_types.UnknownFieldLog(remember=100, max_lines=3, interval_s=3600)
    monkeypatch.setattr(openai_types, "UNKNOWN_FIELDS", log)
    served = await serve()
    caplog.set_level(logging.WARNING, logger="vtllm.frontend.unknown_fields")
    for i in range(8):
        fields = {f"{i}-{j}-" + "k" * 1000: 0 for j in range(60)}
        r = await served.http.post(COMPLETIONS, json={**GOOD_COMPLETION, **fields})
        assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "unknown fields" in rec.getMessage()]
    assert len(lines) == 3, lines
    assert len(log) == 100
    assert all(len(line) < 1000 for line in lines), max(map(len, lines))
    assert "and 55 more" in lines[0]


async def test_n_times_prompts_is_bounded(serve) -> None:
    served = await serve()
    body = {"prompt": ["x"] * 200, "n": 128, "max_tokens": 1}
    r = await served.http.post(COMPLETIONS, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "200 prompts x n=128 asks for 25600 choices; at most 256" in error["message"]
    assert "--max-choices-per-request" in error["message"] and error["param"] == "n"
    assert served.fake.added == []  # refused before anything reached the engine
    ok = await served.http.post(COMPLETIONS, json={"prompt": ["a", "b"], "n": 128, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


async def test_choice_cap_is_configurable_for_chat(serve) -> None:
    config = VtllmConfig()
    config.frontend.max_choices_per_request = 4
    served = await serve(config=config)
    r = await served.http.post(CHAT, json={**GOOD_CHAT, "n": 5})
    assert r.status_code == 400 and "n=5 asks for 5 choices; at most 4" in r.text
    ok = await served.http.post(CHAT, json={**GOOD_CHAT, "n": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


@pytest.mark.parametrize("path", ["/v1/completions/", "/v1/models/", "/health/"])
async def test_trailing_slash_is_404_without_redirect(serve, path: str) -> None:
    served = await serve()
    r = await served.http.request(
        "POST" if "completions" in path else "GET",
        path,
        json=GOOD_COMPLETION,
        headers={"host": "evil.example"},
    )
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["type"] == "not_found_error"


async def test_echoed_values_are_clipped(serve) -> None:
    served = await serve()
    huge = "m" * (1 << 20)
    r = await served.http.post(COMPLETIONS, json={**GOOD_COMPLETION, "model": huge})
    assert r.status_code == 404
    assert len(r.content) < 1000 and "(1048576 characters)" in r.json()["error"]["message"]
    messages = [{"role": "x" * (1 << 20), "content": "hi"}]
    r = await served.http.post(CHAT, json={"messages": messages})
    assert r.status_code == 400 and len(r.content) < 1000, len(r.content)
    # a value echoed by a check deeper in (the OpenAIError backstop clips any message)
    r = await served.http.post(COMPLETIONS, json={**GOOD_COMPLETION, "logit_bias": {huge: 1}})
    assert r.status_code == 400 and len(r.content) < 2500, len(r.content)
    tools = [{"type": "function", "function": {"name": f"{i}" + "t" * 1000}} for i in range(100)]
    choice = {"type": "function", "function": {"name": huge}}
    r = await served.http.post(CHAT, json={**GOOD_CHAT, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400 and len(r.content) < 2500, len(r.content)


async def test_bearer_scheme_is_case_insensitive(serve) -> None:
    config = VtllmConfig()
    config.frontend.api_key = "sekrit"
    served = await serve(config=config)
    for header in ("Bearer sekrit", "bearer sekrit", "BEARER  sekrit", "bEaReR sekrit"):
        r = await served.http.post(
            COMPLETIONS, json=GOOD_COMPLETION, headers={"authorization": header}
        )
        assert r.status_code == 200, (header, r.text)
    for header in ("Basic sekrit", "Bearer sekri", "Bearer sekrit2", "sekrit", "Bearer", ""):
        r = await served.http.post(
            COMPLETIONS, json=GOOD_COMPLETION, headers={"authorization": header}
        )
        assert r.status_code == 401, (header, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


# -- slow senders ------------------------------------------------------------------------


def _deadline_config(header_s: float = 0.5, body_s: float = 0.5) -> VtllmConfig:
    config = VtllmConfig()
    config.frontend.http_header_timeout = header_s
    config.frontend.http_body_timeout = body_s
    return config


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


async def test_slow_headers_are_timed_out(serve) -> None:
    served = await serve(config=_deadline_config(header_s=0.5))
    pieces = [HEAD] + [b"x-slow: 1\r\n"] * 100  # a header line every 0.1 s, never the end
    raw, after_s = await asyncio.to_thread(dribble, _port(served), pieces, 0.1, 5.0)
    reply = parse_raw_reply(raw)
    assert reply.status == 408 and reply.headers["connection"] == "close"
    assert "--http-header-timeout" in reply.json()["error"]["message"]
    assert 0.4 < after_s < 2.0, after_s


async def test_silent_connection_is_closed(serve) -> None:
    served = await serve(config=_deadline_config(header_s=0.5))
    raw, after_s = await asyncio.to_thread(dribble, _port(served), [], 0.1, 5.0)
    assert parse_raw_reply(raw).status == 408 and after_s < 2.0


async def test_slow_body_is_timed_out(serve) -> None:
    served = await serve(config=_deadline_config(body_s=0.5))
    pieces = [HEAD + b"content-length: 100\r\n\r\n{"] + [b" "] * 100
    raw, after_s = await asyncio.to_thread(dribble, _port(served), pieces, 0.1, 5.0)
    reply = parse_raw_reply(raw)
    assert reply.status == 408, raw[:300]
    assert "--http-body-timeout" in reply.json()["error"]["message"]
    assert 0.4 < after_s < 2.0, after_s
    assert served.fake.added == []


async def test_slow_body_to_a_route_that_does_not_read_it(serve) -> None:
    """GET /health answers at once; the body it never reads still has a deadline."""
    served = await serve(config=_deadline_config(body_s=0.5))
    pieces = [b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"] + [b" "] * 100
    raw, after_s = await asyncio.to_thread(dribble, _port(served), pieces, 0.1, 5.0)
    assert parse_raw_reply(raw).status == 200 and after_s < 2.0


async def test_deadlines_spare_a_long_response_and_a_kept_alive_connection(serve) -> None:
    """A response that streams for longer than both deadlines, then a second request on
    the same connection after a pause shorter than the keep-alive timeout."""
    served = await serve(config=_deadline_config(header_s=0.2, body_s=0.2))
    served.fake.token_interval_s = 0.1  # 6 tokens: ~0.6 s

    def two_requests() -> tuple[Reply, Reply]:
        with RawConnection(_port(served)) as conn:
            first = conn.request("POST", COMPLETIONS, {"prompt": "Hi", "stream": True})
            time.sleep(0.3)  # longer than the header deadline, shorter than keep-alive
            return first, conn.request("POST", COMPLETIONS, GOOD_COMPLETION)

    first, second = await asyncio.to_thread(two_requests)
    assert first.status == 200 and first.body.endswith(b"data: [DONE]\n\n"), first.body[-200:]
    assert second.status == 200


async def test_oversized_headers_are_refused(serve) -> None:
    served = await serve()
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (100 * 1024) + b"\r\n\r\n"
    pieces = [head[i : i + 8192] for i in range(0, len(head), 8192)]  # as a network splits it
    raw, after_s = await asyncio.to_thread(dribble, _port(served), pieces, 0.02, 5.0)
    assert parse_raw_reply(raw).status == 400 and after_s < 2.0, raw[:200]
