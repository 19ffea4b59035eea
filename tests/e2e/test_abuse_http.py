"""Hostile HTTP clients against a real ``vtllm serve`` (loopback only, bounded in count and
time): every mistake is a 4xx in OpenAI shape on a connection that then serves a normal
request promptly; bounded fan-out; no redirects; clipped echoes; Bearer in any case; slow
senders cut off. The in-process tests (tests/frontend/test_abuse_http.py) cover each case's
branches; these prove the wiring of ``serve``'s flags and its uvicorn settings."""

from __future__ import annotations

import time

import pytest

from tests.e2e.server import ServerProcess
from tests.frontend.raw_http import RawConnection, dribble, parse_raw_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KEY = "abuse-key"
AUTH = {"authorization": f"bearer {KEY}"}  # lower-case scheme on purpose
GOOD = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
PROMPT_S = 10.0  # "promptly": a 2-token completion on this CPU takes well under this
DEEP = 100_000


@pytest.fixture(scope="module")
def server(smollm2_dir, vt_cache_dir):
    with ServerProcess(
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "256",
        "--api-key",
        KEY,
        "--http-header-timeout",
        "1",
        "--http-body-timeout",
        "1",
        cache_dir=vt_cache_dir,
    ).serving() as srv:
        yield srv


def _bad_then_good(server: ServerProcess, path: str, bad: bytes) -> dict:
    with RawConnection(server.port, timeout_s=30) as conn:
        reply = conn.request("POST", path, bad, AUTH)
        assert reply.status == 400, (reply.status, reply.body[:300], server.tail())
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert conn.reusable
        started = time.monotonic()
        ok = conn.request("POST", "/v1/completions", GOOD, AUTH)
        assert ok.status == 200, ok.body[:300]
        assert time.monotonic() - started < PROMPT_S
    assert server.process.poll() is None, server.tail()
    return error


def _deep(prefix: str, suffix: str) -> bytes:
    return (prefix + "[" * DEEP + "]" * DEEP + suffix).encode()


CHAT_PREFIX = '{"messages": [{"role": "user", "content": "hi"}], '
BAD_BODIES = {
    "tools": ("/v1/chat/completions", _deep(CHAT_PREFIX + '"tools": [{"a": ', "}]}")),
    "chat_template_kwargs": (
        "/v1/chat/completions",
        _deep(CHAT_PREFIX + '"chat_template_kwargs": {"a": ', "}}"),
    ),
    "unknown field": ("/v1/completions", _deep('{"prompt": "hi", "z": ', "}")),
    "tokenize": ("/tokenize", _deep('{"prompt": "hi", "z": ', "}")),
    "invalid UTF-8 key": ("/v1/completions", b'{"prompt": "hi", "z\xff": 1}'),
    "fan-out": ("/v1/completions", b'{"prompt": [' + b'"x",' * 199 + b'"x"], "n": 128}'),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_client_mistake_is_400_then_served(server, case: str) -> None:
    path, bad = BAD_BODIES[case]
    error = _bad_then_good(server, path, bad)
    if case == "fan-out":
        assert "25600 choices; at most 256" in error["message"], error


def test_hygiene(server) -> None:
    with RawConnection(server.port) as conn:
        reply = conn.request("POST", "/v1/completions/", GOOD, {**AUTH, "host": "evil.example"})
        assert reply.status == 404 and "location" not in reply.headers
        reply = conn.request("POST", "/v1/completions", {**GOOD, "model": "m" * (1 << 20)}, AUTH)
        assert reply.status == 404 and len(reply.body) < 1000
        reply = conn.request("POST", "/v1/completions", GOOD, {"authorization": f"Basic {KEY}"})
        assert reply.status == 401
        assert conn.request("POST", "/v1/completions", GOOD, AUTH).status == 200


def test_unknown_field_log_is_bounded(server) -> None:
    before = server.log().count("ignoring unknown fields")
    with RawConnection(server.port) as conn:
        for i in range(30):
            fields = {f"e2e-{i}-{j}-" + "k" * 1000: 0 for j in range(60)}
            reply = conn.request("POST", "/tokenize", {"prompt": "hi", **fields}, AUTH)
            assert reply.status == 200
    assert server.log().count("ignoring unknown fields") - before <= 10


def test_slow_senders_are_cut_off(server) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    raw, after_s = dribble(server.port, [head] + [b"x-a: b\r\n"] * 50, 0.1, 5.0)
    assert parse_raw_reply(raw).status == 408 and after_s < 3.0, (raw[:200], after_s)
    body_head = (
        head
        + (
            f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
            "content-length: 50\r\n\r\n{"
        ).encode()
    )
    raw, after_s = dribble(server.port, [body_head] + [b" "] * 50, 0.1, 5.0)
    assert parse_raw_reply(raw).status == 408 and after_s < 3.0, (raw[:200], after_s)
    with RawConnection(server.port) as conn:
        assert conn.request("POST", "/v1/completions", GOOD, AUTH).status == 200
