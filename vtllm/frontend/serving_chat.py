"""``POST /v1/chat/completions``: messages → chat template → token ids → choices.

Streaming answers are SSE: per choice a role chunk first, then content chunks, the
finish_reason on each choice's last chunk, a usage chunk (``choices: []``) when
``stream_options.include_usage``, then ``data: [DONE]``. An error mid-stream is one event
in OpenAI error shape, then ``data: [DONE]``.

Tools: the model's template renders ``tools``; with ``--tool-call-parser`` the output is
parsed into ``tool_calls`` (``tool_parsers.py``) unless ``tool_choice`` is "none". A
streamed call is two deltas, its id and name, then its arguments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response, StreamingResponse

from vtllm.frontend.generation import ChoiceDelta, ChoiceJob, ChoiceMerger, collect
from vtllm.frontend.logprobs import chat_logprobs
from vtllm.frontend.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    bad_request,
    clip,
    decode_body,
)
from vtllm.frontend.sampling import (
    build_sampling_params,
    check_prompt_chars,
    check_prompt_fits,
    check_token_ids,
    choice_seed,
    explicit_max_tokens,
    parse_logit_bias,
    resolve_max_tokens,
)
from vtllm.frontend.serving_context import (
    ServingContext,
    UsageCounter,
    json_response,
    new_id,
    now_s,
    unless_disconnected,
)
from vtllm.frontend.sse import (
    KEEPALIVE,
    SSE_DONE,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    deltas_with_keepalive,
    sse_error,
    sse_event,
)
from vtllm.frontend.tokenizer import ChatTemplateError
from vtllm.frontend.tool_parsers import HermesToolParser, ParsedText, make_tool_parser


@dataclass
class ToolPlan:
    """What to do with tool calls in this request's output."""

    parser_name: str | None = None  # None: no parsing, the text is the content
    max_calls: int | None = None  # 1 with parallel_tool_calls=false

    def new_parser(self) -> HermesToolParser | None:
        if self.parser_name is None:
            return None
        return make_tool_parser(self.parser_name, self.max_calls)


def _check_supported(request: ChatCompletionRequest) -> None:
    if not request.messages:
        raise bad_request("messages must contain at least one message", "messages")
    for i, message in enumerate(request.messages):
        # as OpenAI: only an assistant message that carries tool_calls may omit content
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise bad_request(
                f"messages[{i}] (role {clip(message.role)!r}) has no content; give it a string "
                "or a list of text parts",
                f"messages[{i}].content",
            )
    fmt = (request.response_format or {}).get("type", "text")
    # json_object is accepted as OpenAI clients send it, but output is not constrained yet
    # (docs/USAGE.md says so); json_schema would promise a shape we cannot guarantee.
    if fmt not in ("text", "json_object"):
        raise bad_request(
            f"response_format type {clip(fmt)!r} is not supported (no constrained decoding yet); "
            "use 'text' or 'json_object' (accepted, not enforced)",
            "response_format",
        )
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def plan_tools(ctx: ServingContext, request: ChatCompletionRequest) -> ToolPlan:
    """Check ``tools``/``tool_choice`` and decide whether to parse the output.

    ``tool_choice`` absent means "auto" with tools and "none" without (OpenAI). A named
    function is accepted and parsed like "auto": the output is not constrained to it."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'a named tool_choice must be {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in _tool_names(tools):
            raise bad_request(
                f"tool_choice names the function {clip(name)!r}, which is not in tools "
                f"({clip(', '.join(_tool_names(tools))) or 'none given'})",
                "tool_choice",
            )
    elif choice == "required":
        raise bad_request(
            "tool_choice 'required' is not supported yet (no constrained decoding); use "
            "'auto' or name the function",
            "tool_choice",
        )
    elif choice not in ("auto", "none"):
        raise bad_request(
            f"tool_choice must be 'auto', 'none' or a named function, got {clip(choice)!r}",
            "tool_choice",
        )
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise bad_request("tool_choice asks for tool calls but no tools were given", "tools")
    if ctx.tool_call_parser is None:
        raise bad_request(
            "this server does not parse tool calls; start it with --tool-call-parser hermes, "
            "or send tool_choice 'none' to get the model's raw text",
            "tools",
        )
    max_calls = 1 if request.parallel_tool_calls is False else None
    return ToolPlan(ctx.tool_call_parser, max_calls)


def chat_prompt_token_ids(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The prompt token ids of a conversation. Raises OpenAIError(400) when the template
    refuses it."""
    try:
        text = ctx.tokenizer.render_chat(
            [message.to_template_dict() for message in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    # The template writes the special tokens (BOS included) itself.
    return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def build_chat_jobs(
    ctx: ServingContext, request: ChatCompletionRequest, response_id: str
) -> list[ChoiceJob]:
    """Validate the request and turn it into one engine request per choice."""
    _check_supported(request)
    check_token_ids(request.stop_token_ids or [], ctx.vocab_size, "stop_token_ids")
    logit_bias = parse_logit_bias(request.logit_bias, ctx.vocab_size)
    # the template renders every message's content: too many characters cannot fit
    num_chars = sum(message.num_content_chars() for message in request.messages)
    check_prompt_chars(num_chars, ctx.tokenizer.max_chars_per_token, ctx.max_model_len, "messages")
    prompt_ids = chat_prompt_token_ids(
        ctx,
        request.messages,
        request.add_generation_prompt,
        request.continue_final_message,
        request.tools,
        request.chat_template_kwargs,
    )
    requested = request.requested_max_tokens()
    field = (
        "max_completion_tokens"
        if explicit_max_tokens(request.max_completion_tokens) is not None
        else "max_tokens"
    )
    check_prompt_fits(
        len(prompt_ids), explicit_max_tokens(requested), ctx.max_model_len, field, "messages"
    )
    max_tokens = resolve_max_tokens(
        requested, ctx.default_max_tokens, len(prompt_ids), ctx.max_model_len
    )
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return [
        ChoiceJob(
            index=i,
            request_id=f"{response_id}-{i}",
            prompt_token_ids=prompt_ids,
            sampling_params=build_sampling_params(
                request,
                max_tokens,
                choice_seed(request.seed, i),
                logprobs,
                logit_bias,
            ),
            stop=request.stop_strings,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        for i in range(request.n)
    ]


async def create_chat_completion(
    ctx: ServingContext, body: bytes, is_disconnected: Callable[[], Awaitable[bool]]
) -> Response:
    request = decode_body(body, ChatCompletionRequest)
    ctx.check_model(request.model)
    ctx.check_num_choices(1, request.n)
    response_id = new_id("chatcmpl")
    tool_plan = plan_tools(ctx, request)
    jobs = await ctx.off_loop(len(body), build_chat_jobs, ctx, request, response_id)
    if request.stream:
        return StreamingResponse(
            _stream(ctx, request, jobs, response_id, tool_plan),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    result = await unless_disconnected(
        _complete(ctx, request, jobs, response_id, tool_plan), is_disconnected
    )
    return json_response(result)


def _message(text: str, finish_reason: str, tool_plan: ToolPlan) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished choice, and its finish_reason ("tool_calls"
    when the model stopped after calling tools)."""
    parser = tool_plan.new_parser()
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parser.push(text)
    parsed += parser.finish()
    if not parsed.tool_calls:
        return {"role": "assistant", "content": parsed.content}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [call.to_dict() for call in parsed.tool_calls],
    }
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


async def _complete(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    jobs: list[ChoiceJob],
    response_id: str,
    tool_plan: ToolPlan,
) -> dict[str, Any]:
    usage = UsageCounter(len(jobs[0].prompt_token_ids))
    async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs, ctx.drain) as merger:
        by_index = await collect(merger)
    choices = []
    for job in jobs:
        deltas = by_index.get(job.index, [])
        for delta in deltas:
            usage.add(delta)
        entries = [entry for delta in deltas for entry in delta.logprobs]
        message, finish_reason = _message(
            "".join(d.text for d in deltas),
            deltas[-1].finish_reason or "abort" if deltas else "abort",
            tool_plan,
        )
        choices.append(
            {
                "index": job.index,
                "message": message,
                "logprobs": chat_logprobs(ctx.tokenizer, entries) if request.logprobs else None,
                "finish_reason": finish_reason,
            }
        )
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": now_s(),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage.to_dict(),
    }


class _StreamedChoice:
    """One choice of a stream: its tool parser and how many tool calls it has sent."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.parser = tool_plan.new_parser()
        self.num_tool_calls = 0

    def deltas(self, item: ChoiceDelta) -> tuple[list[dict[str, Any]], str | None]:
        """The ``delta`` objects for ``item`` (possibly none) and its finish_reason."""
        if self.parser is None:
            return ([{"content": item.text}] if item.text else []), item.finish_reason
        parsed: ParsedText = self.parser.push(item.text)
        if item.finish_reason is not None:
            parsed += self.parser.finish()
        out: list[dict[str, Any]] = [{"content": parsed.content}] if parsed.content else []
        for call in parsed.tool_calls:
            index = self.num_tool_calls
            self.num_tool_calls += 1
            header = {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            out += [{"tool_calls": [header]}, {"tool_calls": [arguments]}]
        finish = item.finish_reason
        if finish == "stop" and self.num_tool_calls:
            finish = "tool_calls"
        return out, finish


async def _stream(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    jobs: list[ChoiceJob],
    response_id: str,
    tool_plan: ToolPlan,
) -> AsyncIterator[bytes]:
    created = now_s()

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_event(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": ctx.model_name,
                "choices": choices,
                **extra,
            }
        )

    usage = UsageCounter(len(jobs[0].prompt_token_ids))
    streamed = {job.index: _StreamedChoice(tool_plan) for job in jobs}
    try:
        async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs, ctx.drain) as merger:
            for job in jobs:
                role = {"role": "assistant", "content": ""}
                yield chunk(
                    [{"index": job.index, "delta": role, "logprobs": None, "finish_reason": None}]
                )
            async for item in deltas_with_keepalive(merger):
                if item is KEEPALIVE:
                    yield SSE_KEEPALIVE
                    continue
                usage.add(item)
                deltas, finish_reason = streamed[item.index].deltas(item)
                if not deltas and finish_reason is None and not item.logprobs:
                    continue
                logprobs = chat_logprobs(ctx.tokenizer, item.logprobs) if request.logprobs else None
                deltas = deltas or [{}]
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    yield chunk(
                        [
                            {
                                "index": item.index,
                                "delta": delta,
                                "logprobs": logprobs if i == 0 else None,
                                "finish_reason": finish_reason if last else None,
                            }
                        ]
                    )
        if request.include_usage:
            yield chunk([], usage=usage.to_dict())
        yield SSE_DONE
    except Exception as e:
        yield sse_error(e)
