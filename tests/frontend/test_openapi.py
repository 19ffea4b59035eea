"""``/openapi.json`` lists every route with request and response schemas, its references
resolve, and real responses match the published response schemas exactly."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from starlette.routing import Route

from tests.frontend.conftest import parse_sse
from vtllm.frontend import response_types as rt

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"messages": [{"role": "user", "content": "Hello"}]}
_KEYWORDS = {
    "$ref", "type", "properties", "required", "items", "anyOf", "oneOf", "enum", "default",
    "title", "description", "additionalProperties", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems", "minProperties",
    "maxProperties", "discriminator", "const", "pattern", "format",
}  # fmt: skip
_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def _walk(node: Any, doc: dict, where: str) -> None:
    """Every schema keyword is a JSON Schema one, every type is valid, every $ref resolves."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, doc, f"{where}[{i}]")
        return
    if not isinstance(node, dict):
        return
    unknown = set(node) - _KEYWORDS
    assert not unknown, f"{where}: not JSON Schema keywords: {unknown}"
    if "type" in node:
        assert node["type"] in _TYPES, where
    if "$ref" in node:
        target: Any = doc
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        assert isinstance(target, dict), where
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _walk(node[key], doc, f"{where}.{key}")
    for key in ("anyOf", "oneOf"):
        if key in node:
            _walk(node[key], doc, f"{where}.{key}")
    for name, prop in node.get("properties", {}).items():
        _walk(prop, doc, f"{where}.{name}")


async def test_openapi_lists_every_route(serve) -> None:
    served = await serve()
    r = await served.http.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "vtllm"
    app_routes = {
        (re.sub(r":\w+}", "}", route.path), method.lower())  # {id:path} is {id} in OpenAPI
        for route in served.app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    doc_routes = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert doc_routes == app_routes
    schemas = doc["components"]["schemas"]
    for name, schema in schemas.items():
        _walk(schema, doc, name)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "200" in op["responses"], (path, method)
            for response in op["responses"].values():
                for media in response.get("content", {}).values():
                    _walk(media["schema"], doc, f"{path} response")
            if method == "post":
                body = op["requestBody"]["content"]["application/json"]["schema"]
                _walk(body, doc, f"{path} request")
    # request schemas carry the decoder's constraints
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    bias = chat["logit_bias"]["anyOf"][0]["additionalProperties"]
    assert bias == {"type": "number", "minimum": -100.0, "maximum": 100.0}
    assert "tools" in chat and "tool_choice" in chat and "messages" in chat
    completion = schemas["CompletionRequest"]
    assert "prompt" in completion["properties"] and "messages" not in completion["properties"]
    assert completion["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    token_ids = completion["properties"]["prompt"]["anyOf"][2]
    assert token_ids["items"] == {"type": "integer", "minimum": 0, "maximum": 999}  # vocab 1000
    assert schemas["TokenizeCompletionRequest"]["required"] == ["prompt"]
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    assert schemas["ChatCompletionResponse"]["additionalProperties"] is False
    assert "security" not in doc["paths"][CHAT]["post"]  # no API key configured


def _conforms(payload: Any, type_: type) -> None:
    msgspec.convert(payload, type_, strict=True)


async def test_responses_match_their_schemas(serve) -> None:
    served = await serve(text="Hello world! 🙂 The end.")
    r = await served.http.post(CHAT, json={**USER, "logprobs": True, "top_logprobs": 2})
    _conforms(r.json(), rt.ChatCompletionResponse)
    r = await served.http.post(
        CHAT, json={**USER, "stream": True, "stream_options": {"include_usage": True}}
    )
    for payload in parse_sse(r.text)[:-1]:
        _conforms(json.loads(payload), rt.ChatCompletionChunk)
    r = await served.http.post(COMPLETIONS, json={"prompt": "Hi", "logprobs": 1, "echo": True})
    _conforms(r.json(), rt.CompletionResponse)
    r = await served.http.post(
        COMPLETIONS,
        json={"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}},
    )
    for payload in parse_sse(r.text)[:-1]:
        _conforms(json.loads(payload), rt.CompletionResponse)
    _conforms((await served.http.get("/v1/models")).json(), rt.ModelList)
    _conforms((await served.http.get("/version")).json(), rt.VersionResponse)
    r = await served.http.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True})
    _conforms(r.json(), rt.TokenizeResponse)
    _conforms(
        (await served.http.post("/detokenize", json={"tokens": [5]})).json(), rt.DetokenizeResponse
    )
    _conforms((await served.http.post(CHAT, json={"messages": 1})).json(), rt.ErrorResponse)


async def test_error_responses_have_no_stray_keys(serve) -> None:
    served = await serve()
    r = await served.http.get("/v1/completions")
    assert r.status_code == 405
    _conforms(r.json(), rt.ErrorResponse)
