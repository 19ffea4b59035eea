"""OpenAI request bodies as msgspec Structs, and the error type every route answers with.

Bodies are decoded with ``decode_body``: a wrong type or out-of-range value is an
``OpenAIError`` 400 whose ``param`` names the field (msgspec says ``at `$.field```).
Unknown fields are ignored (SDKs send some we do not use).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

T = TypeVar("T")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]


class OpenAIError(Exception):
    """An error answered in OpenAI shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


_FIELD_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: bytes, type_: type[T]) -> T:
    """JSON body → ``type_``; raises OpenAIError(400) naming the offending field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        match = _FIELD_PATH.search(str(e))
        param = match.group(1) if match and match.group(1) else None
        raise bad_request(f"invalid request body: {e}", param) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content a plain string."""
        if isinstance(self.content, list):
            content: str | None = "\n".join(part.text for part in self.content)
        else:
            content = self.content
        out: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class _SamplingFields(msgspec.Struct):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1 or 0 = off
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the legacy ``max_tokens`` when set (> 0)."""
        if self.max_completion_tokens is not None and self.max_completion_tokens > 0:
            return self.max_completion_tokens
        return self.max_tokens


# One prompt: a string or token ids; or a batch: strings or token-id lists. msgspec allows
# one array type per union, so the list's items are checked in ``prompts()``.
PromptInput = str | list[str | int | list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput | None = None
    echo: bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    best_of: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists. Raises OpenAIError(400)."""
        prompt = self.prompt
        if prompt is None:
            raise bad_request("prompt is required", "prompt")
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be an empty list", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]  # type: ignore[arg-type]
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "token-id lists (not a mix)",
            "prompt",
        )
