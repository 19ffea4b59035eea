"""The shapes of every JSON response, as msgspec Structs: the response schemas of
``/openapi.json``.

The handlers build plain dicts; tests decode real responses into these structs with
unknown fields forbidden, so a key added to or dropped from a response without changing
its struct fails a test instead of drifting from the published schema.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class _Response(msgspec.Struct, forbid_unknown_fields=True):
    pass


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    error: ErrorDetail


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # present when part of the prompt came from the prefix cache
    prompt_tokens_details: PromptTokensDetails | None = None


# -- chat ------------------------------------------------------------------------------


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCall


class TopLogprob(_Response):
    token: str
    logprob: float | None  # null for -inf
    bytes: list[int]


class ChatTokenLogprob(_Response):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(_Response):
    role: Literal["assistant"]
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCall] | None = None  # present when the model called tools


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Response):
    arguments: str
    name: str | None = None  # in a call's first delta only


class ToolCallDelta(_Response):
    index: int
    function: FunctionCallDelta
    id: str | None = None  # in a call's first delta only
    type: Literal["function"] | None = None  # in a call's first delta only


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Response):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # the last chunk, with stream_options.include_usage


# -- completions -------------------------------------------------------------------------


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # null in stream chunks before the last


class CompletionResponse(_Response):
    """A completion, and (with ``usage`` only on the last) each streamed chunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always present when not streaming


# -- the rest ----------------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


# -- embeddings ------------------------------------------------------------------------


class Embedding(_Response):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
