"""OpenAI request bodies as msgspec Structs, and the error type every route answers with.

Bodies are decoded with ``decode_body``: a wrong type or out-of-range value is an
``OpenAIError`` 400 whose ``param`` names the field (msgspec says ``at `$.field```).
These structs are also the request schemas of ``/openapi.json``: every constraint a
request must meet is written here, as a type or a ``msgspec.Meta``.

Fields we know but cannot honour yet (``logit_bias``, guided decoding, ...) are declared
so that only their "off" value is accepted; anything else is a 400 saying it is not
supported. Unknown fields are ignored (SDKs send some we do not use), with a warning in
a bounded, rate-limited server log (unknown_fields.py); a body with more than
``MAX_UNKNOWN_FIELDS`` of them is refused. Client values echoed in an error are clipped to
``MAX_ECHO_CHARS``.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from vtllm.frontend.unknown_fields import UnknownFieldLog
from vtllm.protocol.limits import (
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_RANGE,
    STOP_STRING_META,
    list_meta,
    sampling_meta,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Client values echoed in errors (a model name, a bad enum value) are cut to this length,
# and a whole error message (whatever it quotes) to the second.
MAX_ECHO_CHARS = 200
MAX_ERROR_MESSAGE_CHARS = 2000
# A body naming more top-level fields than its endpoint knows plus this many is refused.
MAX_UNKNOWN_FIELDS = 64

# Every integer that travels to the engine fits in int64 (the msgpack wire format).
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
# The bounds of the sampling fields are the protocol's (protocol/limits.py), so the
# engine core never refuses what this schema accepted.
TopLogprobs = Annotated[int, sampling_meta("logprobs")]


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``str(value)`` cut to ``limit`` characters (saying how long it was): what an error
    message or log line may echo of a client's value."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


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
        message = clip(message, MAX_ERROR_MESSAGE_CHARS)  # the backstop for any echo
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = clip(param) if param is not None else None
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
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")

# Declared fields whose only accepted value is "off": the message for any other value.
UNSUPPORTED_FIELDS = {
    "prompt_logprobs": "prompt_logprobs is not supported yet; remove it or send null",
    "use_beam_search": "beam search is not supported; remove use_beam_search",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported yet; "
    "stop strings are always cut from the output",
    "skip_special_tokens": "skip_special_tokens=false is not supported yet; special tokens "
    "are always skipped in the output text",
    "functions": "functions is the deprecated form of tools; send tools instead",
    "function_call": "function_call is the deprecated form of tool_choice; send tool_choice",
    "suffix": "suffix is not supported yet (no fill-in-the-middle); remove it",
    "chat_template": "a per-request chat_template is not supported; the model's own "
    "template is used (chat_template_kwargs are passed to it)",
}

UNKNOWN_FIELDS = UnknownFieldLog()


def decode_body(body: bytes, type_: type[T]) -> T:
    """JSON body → ``type_``; raises OpenAIError(400) naming the offending field."""
    try:
        request = msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        match = _FIELD_PATH.search(str(e))
        param = match.group(1) if match and match.group(1) else None
        missing = _MISSING_FIELD.search(str(e))
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        field = (param or "").split(".", 1)[0].split("[", 1)[0]
        if field in UNSUPPORTED_FIELDS:
            raise bad_request(UNSUPPORTED_FIELDS[field], field) from None
        raise bad_request(
            f"invalid request body: {clip(e, 2 * MAX_ECHO_CHARS)}",
            clip(param) if param is not None else None,
        ) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {clip(e)}") from None
    except RecursionError:  # check_body bounds the depth first; this is the backstop
        raise bad_request("request body nests JSON too deeply") from None
    _check_unknown_fields(body, type_)
    return request


def _check_unknown_fields(body: bytes, type_: type) -> None:
    """Refuse a body with more than MAX_UNKNOWN_FIELDS fields ``type_`` does not know;
    report the others (ignored) to the bounded log."""
    fields = getattr(type_, "__struct_fields__", None)
    if fields is None:
        return
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw]).keys()
    except (msgspec.DecodeError, RecursionError):
        raise bad_request("request body is not valid JSON") from None
    unknown = keys - set(fields)
    if len(unknown) > MAX_UNKNOWN_FIELDS:
        raise bad_request(
            f"request body has {len(unknown)} fields {type_.__name__} does not know; at "
            f"most {MAX_UNKNOWN_FIELDS} unknown fields are ignored (remove them)"
        )
    if unknown:
        UNKNOWN_FIELDS.report(type_.__name__, sorted(unknown))


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

    def num_content_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content)
        return len(self.content or "")

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


def _off(description: str) -> Any:
    return msgspec.Meta(description=f"Not supported yet: {description}")


class _SamplingFields(msgspec.Struct):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    # 0 or negative = unset (as OpenAI clients send -1 for "no limit"): any int64
    max_tokens: Int64 | None = None
    temperature: Annotated[float, sampling_meta("temperature")] | None = None
    top_p: Annotated[float, sampling_meta("top_p")] | None = None
    top_k: Annotated[int, sampling_meta("top_k")] | None = None  # -1 or 0 = off
    min_p: Annotated[float, sampling_meta("min_p")] | None = None
    seed: Annotated[int, sampling_meta("seed")] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 1
    stop: (
        Annotated[str, STOP_STRING_META]
        | Annotated[list[Annotated[str, STOP_STRING_META]], list_meta("stop")]
        | None
    ) = None
    stop_token_ids: Annotated[list[NonNegInt], list_meta("stop_token_ids")] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, sampling_meta("min_tokens")] = 0
    presence_penalty: Annotated[float, sampling_meta("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, sampling_meta("frequency_penalty")] | None = None
    repetition_penalty: Annotated[float, sampling_meta("repetition_penalty")] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    # token id (as a JSON object key) → bias added to its logit, -100..100
    logit_bias: (
        Annotated[dict[str, Annotated[float, LOGIT_BIAS_RANGE.meta()]], list_meta("logit_bias")]
        | None
    ) = None
    prompt_logprobs: Annotated[None, _off("only null")] = None
    use_beam_search: Annotated[Literal[False], _off("only false")] = False
    include_stop_str_in_output: Annotated[Literal[False], _off("only false")] = False
    skip_special_tokens: Annotated[Literal[True], _off("only true")] = True
    # vLLM's output formats (frontend/structured_output.py checks and converts them)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] = []
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
    functions: Annotated[None, _off("only null (send tools)")] = None
    function_call: Annotated[None, _off("only null (send tool_choice)")] = None
    chat_template: Annotated[None, _off("only null")] = None

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
    suffix: Annotated[str, msgspec.Meta(max_length=0), _off('only "" or null')] | None = None
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


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` of a plain prompt (as ``/v1/completions`` tokenizes it)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` of a conversation (as ``/v1/chat/completions`` renders it)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # the chat template writes its special tokens itself
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegInt]
