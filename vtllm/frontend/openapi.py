"""``GET /openapi.json``: the API described from the structs that decode requests
(``openai_types``) and describe responses (``response_types``), so the document accepts
exactly what the server accepts (``msgspec.json.schema_components``).

OpenAPI 3.1 (JSON Schema 2020-12: ``null`` is a type). Streaming answers are
``text/event-stream``; each ``data:`` event is a ``ChatCompletionChunk`` or a
``CompletionResponse`` (chunk), named in the response's description and components.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vtllm.frontend import response_types as rt
from vtllm.frontend.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vtllm.frontend.serving_embedding import EmbeddingRequest

_REF = "#/components/schemas/{name}"

_SCHEMA_TYPES: tuple[type, ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    rt.EmbeddingResponse,
    rt.ChatCompletionResponse,
    rt.ChatCompletionChunk,
    rt.CompletionResponse,
    rt.ModelList,
    rt.TokenizeResponse,
    rt.DetokenizeResponse,
    rt.VersionResponse,
    rt.ErrorResponse,
)


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int) -> dict[str, Any]:
    meaning = {
        400: "Invalid request: the message and `param` name the field.",
        401: "Missing or wrong API key.",
        404: "Unknown model.",
        413: "Request body larger than --max-request-bytes.",
        503: "The engine core is not available.",
    }
    return {
        str(code): {"description": meaning[code], "content": _json(_ref(rt.ErrorResponse))}
        for code in codes
    }


def _generation_route(
    summary: str, request: type, response: type, chunk: type, protected: bool
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": {
                "200": {
                    "description": (
                        f"A {response.__name__} (JSON); with stream: true, server-sent events "
                        f"`data: <{chunk.__name__}>` ending with `data: [DONE]`."
                    ),
                    "content": {
                        **_json(_ref(response)),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 413, 503),
            },
            **_security(protected),
        }
    }


def _security(protected: bool) -> dict[str, Any]:
    return {"security": [{"bearer": []}]} if protected else {}


def _tighten_requests(components: dict[str, Any], vocab_size: int) -> None:
    """What the handlers check beyond the structs, written into the request schemas:
    ``messages``/``prompt`` are required (the structs let them be absent only to answer
    a clearer 400), a prompt's forms cannot mix (msgspec decodes one array type per
    union), and token ids must be in the vocabulary."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    chat = components["ChatCompletionRequest"]
    chat["required"] = sorted({*chat["required"], "messages"})
    completion = components["CompletionRequest"]
    completion["required"] = sorted({*completion["required"], "prompt"})
    prompt = completion["properties"]["prompt"]
    prompt.pop("default", None)
    prompt["anyOf"] = [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        token_ids,
        {"type": "array", "items": token_ids, "minItems": 1},
    ]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        stop_ids = components[name]["properties"]["stop_token_ids"]
        stop_ids["anyOf"][0]["items"] = token_id
    components["DetokenizeRequest"]["properties"]["tokens"]["items"] = token_id
    embedding_input = components["EmbeddingRequest"]["properties"]["input"]
    embedding_input.clear()
    embedding_input["anyOf"] = [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        token_ids,
        {"type": "array", "items": token_ids, "minItems": 1},
    ]


def openapi_document(version: str, api_key_required: bool, vocab_size: int) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document. ``api_key_required`` marks the protected routes
    with the bearer scheme; ``vocab_size`` bounds token ids."""
    _, components = msgspec.json.schema_components(_SCHEMA_TYPES, ref_template=_REF)
    _tighten_requests(components, vocab_size)
    protected = api_key_required
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation_route(
            "Chat completion (OpenAI-compatible)",
            ChatCompletionRequest,
            rt.ChatCompletionResponse,
            rt.ChatCompletionChunk,
            protected,
        ),
        "/v1/completions": _generation_route(
            "Text completion (OpenAI-compatible)",
            CompletionRequest,
            rt.CompletionResponse,
            rt.CompletionResponse,
            protected,
        ),
        "/v1/embeddings": {
            "post": {
                "summary": "Embeddings: the model's pooled final hidden states (--pooling-type)",
                "requestBody": {"required": True, "content": _json(_ref(EmbeddingRequest))},
                "responses": {
                    "200": {
                        "description": "One L2-normalised vector per input",
                        "content": _json(_ref(rt.EmbeddingResponse)),
                    },
                    **_errors(400, 401, 404, 413, 503),
                },
                **_security(protected),
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The served model, with its max_model_len",
                "responses": {
                    "200": {"description": "Model list", "content": _json(_ref(rt.ModelList))},
                    **_errors(401),
                },
                **_security(protected),
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "The served model's card (the SDK's models.retrieve); 404 for another id",
                "parameters": [
                    {
                        "name": "model_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {
                    "200": {"description": "Model card", "content": _json(_ref(rt.ModelCard))},
                    **_errors(401, 404),
                },
                **_security(protected),
            }
        },
        "/tokenize": {
            "post": {
                "summary": "Token ids of a prompt or of a rendered conversation",
                "requestBody": {
                    "required": True,
                    "content": _json(
                        {"oneOf": [_ref(TokenizeCompletionRequest), _ref(TokenizeChatRequest)]}
                    ),
                },
                "responses": {
                    "200": {
                        "description": "Token ids",
                        "content": _json(_ref(rt.TokenizeResponse)),
                    },
                    **_errors(400, 401, 404, 413, 503),
                },
                **_security(protected),
            }
        },
        "/detokenize": {
            "post": {
                "summary": "Text of token ids",
                "requestBody": {"required": True, "content": _json(_ref(DetokenizeRequest))},
                "responses": {
                    "200": {"description": "Text", "content": _json(_ref(rt.DetokenizeResponse))},
                    **_errors(400, 401, 404, 413, 503),
                },
                **_security(protected),
            }
        },
        "/health": {
            "get": {
                "summary": "200 while the engine core is alive",
                "responses": {"200": {"description": "Alive (empty body)"}, **_errors(503)},
            }
        },
        "/ping": {
            "get": {
                "summary": "Same as /health (SageMaker's probe, as vLLM serves it)",
                "responses": {"200": {"description": "Alive (empty body)"}, **_errors(503)},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/version": {
            "get": {
                "summary": "vtllm version",
                "responses": {
                    "200": {"description": "Version", "content": _json(_ref(rt.VersionResponse))}
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {
                    "200": {"description": "OpenAPI 3.1", "content": _json({"type": "object"})}
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "vtllm",
            "version": version,
            "description": "OpenAI-compatible LLM serving. See docs/USAGE.md (HTTP API).",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
