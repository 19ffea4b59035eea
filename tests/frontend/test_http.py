"""The HTTP app over a real socket against FakeEngine: shapes, errors, max_tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tests.frontend.conftest import write_model_dir
from vtllm.config import VtllmConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _user(text: str = "Hello") -> dict:
    return {"messages": [{"role": "user", "content": text}]}


async def test_chat_non_streaming_shape(serve) -> None:
    served = await serve(text="Hello world! The end.")
    r = await served.http.post(CHAT, json={"model": "fake-model", **_user()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello world! The end."},
        "logprobs": None,
        "finish_reason": "stop",
    }
    added = served.fake.added[0]
    assert body["usage"] == {
        "prompt_tokens": len(added.prompt_token_ids),
        "completion_tokens": 6,
        "total_tokens": len(added.prompt_token_ids) + 6,
    }
    # the chat template was applied: ChatML special tokens in the prompt ids
    assert added.prompt_token_ids[0] == 1  # <|im_start|>


async def test_completion_stop_string_and_n(serve) -> None:
    served = await serve(text="Hello world! The end.")
    r = await served.http.post(
        COMPLETIONS, json={"prompt": "Say", "stop": ["! Th"], "n": 2, "seed": 10, "echo": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["SayHello world", "SayHello world"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    seeds = sorted(a.sampling_params.seed for a in served.fake.added)
    assert seeds == [10, 11]
    assert len({a.request_id for a in served.fake.added}) == 2


async def test_max_tokens_unset_and_default(serve) -> None:
    served = await serve()
    for extra in ({}, {"max_tokens": None}, {"max_tokens": 0}, {"max_tokens": -1}):
        r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", **extra})
        assert r.status_code == 200, r.text
    assert [a.sampling_params.max_tokens for a in served.fake.added] == [None] * 4
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert served.fake.added[-1].sampling_params.max_tokens == 2


async def test_serving_default_max_tokens(serve) -> None:
    config = VtllmConfig()
    config.frontend.default_max_tokens = 3
    served = await serve(config=config)
    r = await served.http.post(CHAT, json={**_user(), "max_tokens": -1})
    assert r.status_code == 200
    assert served.fake.added[-1].sampling_params.max_tokens == 3


async def test_too_long_is_400_with_numbers(serve) -> None:
    served = await serve(max_model_len=64)
    r = await served.http.post(COMPLETIONS, json={"prompt": [1] * 40, "max_tokens": 30})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == (
        "prompt has 40 tokens and max_tokens is 30, together 70, but max_model_len is 64; shorten the "
        "prompt, lower max_tokens, or raise --max-model-len"
    )
    assert set(error) == {"message", "type", "param", "code"}
    r = await served.http.post(CHAT, json={**_user("hello " * 80)})
    assert r.status_code == 400 and "max_model_len is 64" in r.json()["error"]["message"]
    assert served.fake.added == []


async def test_client_errors_are_openai_shaped(serve) -> None:
    served = await serve()
    cases = [
        (CHAT, b"{not json", 400, None),
        (CHAT, json.dumps({**_user(), "top_p": "x"}).encode(), 400, "top_p"),
        (CHAT, json.dumps({"messages": []}).encode(), 400, "messages"),
        (COMPLETIONS, json.dumps({"prompt": [10**6]}).encode(), 400, "prompt"),
        (CHAT, json.dumps({**_user(), "model": "gpt-9"}).encode(), 404, "model"),
        (
            CHAT,
            json.dumps({**_user(), "response_format": {"type": "json_schema"}}).encode(),
            400,
            "response_format",
        ),
    ]
    for path, body, status, param in cases:
        r = await served.http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param
    r = await served.http.post(CHAT, content=b"x" * (33 * 1024**2))
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    r = await served.http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


async def test_model_without_template_is_400(serve, tmp_path: Path) -> None:
    served = await serve(model_path=write_model_dir(tmp_path / "plain", chat_template=None))
    r = await served.http.post(CHAT, json=_user())
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi"})
    assert r.status_code == 200


async def test_models_version_health(serve) -> None:
    served = await serve()
    models = (await served.http.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["max_model_len"] == 256
    assert "version" in (await served.http.get("/version")).json()
    assert (await served.http.get("/health")).status_code == 200


_PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", COMPLETIONS, {"prompt": "Hi"}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [5]}),
]
_OPEN = ["/health", "/metrics", "/version", "/openapi.json"]


async def _check_api_key(served, key: str) -> None:
    for method, path, body in _PROTECTED:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = await served.http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json() == {
                "error": {
                    "message": "missing or wrong API key (Authorization: Bearer <key>)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        r = await served.http.request(
            method, path, json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 200, (path, r.text)
    for path in _OPEN:
        assert (await served.http.get(path)).status_code == 200, path


async def test_api_key(serve) -> None:
    config = VtllmConfig()
    config.frontend.api_key = "sekrit"
    served = await serve(config=config)
    await _check_api_key(served, "sekrit")
    doc = (await served.http.get("/openapi.json")).json()
    assert doc["paths"]["/tokenize"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/metrics"]["get"]


async def test_api_key_from_env(serve, monkeypatch) -> None:
    monkeypatch.setenv("VT_API_KEY", "from-env")
    served = await serve()
    await _check_api_key(served, "from-env")


async def test_unsupported_fields_are_400_not_ignored(serve) -> None:
    served = await serve()
    user = _user()
    cases = [
        (CHAT, {**user, "logit_bias": {"x": 10}}, "logit_bias", "must be token ids"),
        (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"999999": -1}}, "logit_bias", "range"),
        (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": -101}}, "logit_bias[...]", ">= -100"),
        (
            CHAT,
            {**user, "response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema needs",
        ),
        (COMPLETIONS, {"prompt": "Hi", "guided_json": "{bad"}, "guided_json", "not valid JSON"),
        (COMPLETIONS, {"prompt": "Hi", "use_beam_search": True}, "use_beam_search", "beam"),
        (COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, "suffix", "not supported yet"),
        (CHAT, {**user, "functions": [{"name": "f"}]}, "functions", "send tools"),
        (CHAT, {**user, "top_logprobs": 3}, "top_logprobs", "logprobs: true"),
        (CHAT, {**user, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**6]}, "stop_token_ids", "vocabulary"),
        (COMPLETIONS, {"prompt": "Hi", "priority": 2**70}, "priority", "<="),
        (COMPLETIONS, {"prompt": "Hi", "seed": -(2**64)}, "seed", ">="),
    ]
    for path, body, param, words in cases:
        r = await served.http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    assert served.fake.added == []
    # the "off" values are accepted
    r = await served.http.post(
        COMPLETIONS, json={"prompt": "Hi", "logit_bias": {}, "use_beam_search": False}
    )
    assert r.status_code == 200, r.text


async def test_logprobs_shapes(serve) -> None:
    served = await serve(text="Hello world")
    r = await served.http.post(CHAT, json={**_user(), "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == list(b"Hello")
    assert served.fake.added[-1].sampling_params.logprobs == 2
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "logprobs": 0, "echo": True})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hello", " world"]
    assert logprobs["text_offset"] == [2, 7]  # after the echoed prompt "Hi"


async def test_template_failure_on_content_is_400(serve) -> None:
    served = await serve()
    r = await served.http.post(CHAT, json={"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


async def test_logit_bias_and_json_object_reach_the_engine(serve) -> None:
    served = await serve()
    response = await served.http.post(
        COMPLETIONS, json={"prompt": "Hi", "logit_bias": {"5": 7.5, "9": -100}}
    )
    assert response.status_code == 200, response.text
    assert served.fake.added[-1].sampling_params.logit_bias == {5: 7.5, 9: -100.0}
    response = await served.http.post(
        CHAT, json={**_user(), "response_format": {"type": "json_object"}}
    )
    assert response.status_code == 200, response.text


async def test_messages_without_content_are_a_clear_400(serve) -> None:
    served = await serve()
    for messages in (
        [{"role": "user"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant"}],
    ):
        response = await served.http.post(CHAT, json={"messages": messages})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "has no content" in error["message"] and "TypeError" not in error["message"]
        assert error["param"].startswith("messages[")
