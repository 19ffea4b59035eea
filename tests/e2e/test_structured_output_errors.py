"""A JSON schema that passes the frontend's checks but that xgrammar cannot compile, sent
to a real ``vtllm serve``: the driver worker's compile fails before any step, and the
engine core ends the request as INVALID_REQUEST, so the client gets a 400 naming
xgrammar's reason (not a 500); a stream gets the same error as its last event. The same
server then answers a valid structured request (nothing was left stuck)."""

from __future__ import annotations

import json

import httpx

from tests.e2e.conftest import QUESTION

UNCOMPILABLE = {"type": "integer", "minimum": 5, "maximum": 1}  # valid JSON, empty range


def _body(schema: dict, **extra) -> dict:
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    return {"messages": QUESTION, "max_tokens": 8, "response_format": response_format, **extra}


def test_an_uncompilable_schema_is_a_400_and_a_stream_error_event(server, model):
    url = f"{server.url}/v1/chat/completions"
    response = httpx.post(url, json=_body(UNCOMPILABLE, model=model), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "does not compile" in error["message"]
    assert "minimum greater than maximum" in error["message"]

    with httpx.stream("POST", url, json=_body(UNCOMPILABLE, model=model, stream=True)) as r:
        assert r.status_code == 200  # headers went out before the engine answered
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error"
    assert "minimum greater than maximum" in error["message"]

    schema = {"type": "integer", "minimum": 1, "maximum": 5}
    response = httpx.post(url, json=_body(schema, model=model, max_tokens=4), timeout=60)
    assert response.status_code == 200, response.text
    assert 1 <= int(response.json()["choices"][0]["message"]["content"]) <= 5


def test_a_regex_this_vocabulary_cannot_continue_is_a_400(server, model):
    """SmolLM2 has no token for the byte 0xF2, so no output can start U+A21E9 (the HTTP
    fuzzer found this as a 500: an empty mask, then a token the grammar refused)."""
    body = {"messages": QUESTION, "max_tokens": 8, "guided_regex": "\U000a21e9"}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "allows no token of this model's vocabulary" in response.json()["error"]["message"]
