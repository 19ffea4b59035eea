"""``POST /v1/chat/completions``: messages → chat template → token ids → choices.

Streaming answers are SSE: per choice a role chunk first, then content chunks, the
finish_reason on each choice's last chunk, a usage chunk (``choices: []``) when
``stream_options.include_usage``, then ``data: [DONE]``. An error mid-stream is one event
in OpenAI error shape, then ``data: [DONE]``.

Tools: the chat template renders ``tools`` (``chat_template.py``); ``tool_choice`` decides
how the output is read (``tool_choice.py``: parsed by the tool-call parser, or forced into
a JSON schema by structured output); ``chat_output.py`` turns each choice's text into
``reasoning_content`` (``--reasoning-parser``), ``content`` and ``tool_calls``. A streamed
call is two deltas, its id and name, then its arguments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from vtllm.frontend.chat_output import ChoiceOutput
from vtllm.frontend.generation import ChoiceDelta, ChoiceJob, ChoiceMerger, collect
from vtllm.frontend.logprobs import chat_logprobs
from vtllm.frontend.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    bad_request,
    clip,
    decode_body,
)
from vtllm.frontend.reasoning import THINK_END, expects_thinking
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
    delta_batches,
    sse_error,
    sse_event,
)
from vtllm.frontend.structured_output import structured_output_spec
from vtllm.frontend.tokenizer import ChatTemplateError
from vtllm.frontend.tool_choice import ToolPlan, plan_tools
from vtllm.protocol.messages import StructuredOutputKind, StructuredOutputSpec


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
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


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
    text = render_chat_prompt(
        ctx, messages, add_generation_prompt, continue_final_message, tools, chat_template_kwargs
    )
    # The template writes the special tokens (BOS included) itself.
    return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat_prompt(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation. Raises OpenAIError(400) when the template
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
        raise bad_request(str(e), e.param) from None
    return text


def _output_format(
    ctx: ServingContext, request: ChatCompletionRequest, tool_plan: ToolPlan, prompt_text: str
) -> StructuredOutputSpec | None:
    """The structured output of the request: its response_format (or guided_* fields), or
    the schema of a forced tool_choice; with a reasoning parser, enforced only after the
    thinking ends. Raises OpenAIError(400)."""
    spec = structured_output_spec(request)  # 400 when malformed
    if tool_plan.forced:
        if spec is not None:
            raise bad_request(
                "tool_choice 'required' or a named function already fixes the output format; "
                "drop response_format (or the guided_* field)",
                "tool_choice",
            )
        spec = StructuredOutputSpec(
            StructuredOutputKind.JSON_SCHEMA, tool_plan.forced_schema_json()
        )
    if spec is None or ctx.reasoning_parser is None:
        return spec
    if not expects_thinking(ctx.reasoning_parser, prompt_text):
        return spec
    end_id = ctx.tokenizer.tokenizer.token_to_id(THINK_END)
    if end_id is None:
        raise bad_request(
            f"this model's tokenizer has no single {THINK_END} token, so an output format "
            "cannot start after the thinking; drop the format or --reasoning-parser",
            "response_format",
        )
    spec.start_after_token_id = end_id
    return spec


def build_chat_jobs(
    ctx: ServingContext, request: ChatCompletionRequest, response_id: str, tool_plan: ToolPlan
) -> tuple[list[ChoiceJob], str]:
    """Validate the request and turn it into one engine request per choice; also the
    rendered prompt text."""
    _check_supported(request)
    check_token_ids(request.stop_token_ids or [], ctx.vocab_size, "stop_token_ids")
    logit_bias = parse_logit_bias(request.logit_bias, ctx.vocab_size)
    # the template renders every message's content: too many characters cannot fit
    num_chars = sum(message.num_content_chars() for message in request.messages)
    check_prompt_chars(num_chars, ctx.tokenizer.max_chars_per_token, ctx.max_model_len, "messages")
    prompt_text = render_chat_prompt(
        ctx,
        request.messages,
        request.add_generation_prompt,
        request.continue_final_message,
        request.tools,
        request.chat_template_kwargs,
    )
    # The template writes the special tokens (BOS included) itself.
    prompt_ids = ctx.tokenizer.encode(prompt_text, add_special_tokens=False)
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
    structured_output = _output_format(ctx, request, tool_plan, prompt_text)
    jobs = [
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
    for job in jobs:
        job.sampling_params.structured_output = structured_output
    return jobs, prompt_text


async def create_chat_completion(
    ctx: ServingContext, body: bytes, is_disconnected: Callable[[], Awaitable[bool]]
) -> Response:
    request = decode_body(body, ChatCompletionRequest)
    ctx.check_model(request.model)
    ctx.check_num_choices(1, request.n)
    response_id = new_id("chatcmpl")
    tool_plan = plan_tools(request, ctx.tool_call_parser, can_enforce=True)
    jobs, prompt_text = await ctx.off_loop(
        len(body), build_chat_jobs, ctx, request, response_id, tool_plan
    )

    def new_output() -> ChoiceOutput:
        return ChoiceOutput(tool_plan, ctx.reasoning_parser, prompt_text)

    if request.stream:
        return StreamingResponse(
            _stream(ctx, request, jobs, response_id, new_output),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    result = await unless_disconnected(
        _complete(ctx, request, jobs, response_id, new_output), is_disconnected
    )
    return json_response(result)


async def _complete(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    jobs: list[ChoiceJob],
    response_id: str,
    new_output: Callable[[], ChoiceOutput],
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
        message, finish_reason = new_output().message(
            "".join(d.text for d in deltas),
            deltas[-1].finish_reason or "abort" if deltas else "abort",
        )
        message["role"] = ctx.response_role  # --response-role
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


async def _stream(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    jobs: list[ChoiceJob],
    response_id: str,
    new_output: Callable[[], ChoiceOutput],
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
    streamed = {job.index: new_output() for job in jobs}
    try:
        async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs, ctx.drain) as merger:
            for job in jobs:
                role = {"role": ctx.response_role, "content": ""}
                yield chunk(
                    [{"index": job.index, "delta": role, "logprobs": None, "finish_reason": None}]
                )
            async for batch in delta_batches(merger):
                if batch is KEEPALIVE:
                    yield SSE_KEEPALIVE
                    continue
                events = []
                for item in batch:
                    events.extend(_item_events(ctx, request, item, streamed, usage, chunk))
                if events:
                    yield b"".join(events)
        if request.include_usage:
            yield chunk([], usage=usage.to_dict())
        yield SSE_DONE
    except Exception as e:
        yield sse_error(e)


def _item_events(
    ctx: ServingContext,
    request: ChatCompletionRequest,
    item: ChoiceDelta,
    streamed: dict[int, ChoiceOutput],
    usage: UsageCounter,
    chunk: Callable[..., bytes],
) -> list[bytes]:
    """The SSE events of one delta (none while the output parser holds text back)."""
    usage.add(item)
    deltas, finish_reason = streamed[item.index].deltas(item.text, item.finish_reason)
    if not deltas and finish_reason is None and not item.logprobs:
        return []
    logprobs = chat_logprobs(ctx.tokenizer, item.logprobs) if request.logprobs else None
    deltas = deltas or [{}]
    return [
        chunk(
            [
                {
                    "index": item.index,
                    "delta": delta,
                    "logprobs": logprobs if i == 0 else None,
                    "finish_reason": finish_reason if i == len(deltas) - 1 else None,
                }
            ]
        )
        for i, delta in enumerate(deltas)
    ]
