"""``POST /v1/chat/completions``: messages → chat template → token ids → choices.

Streaming answers are SSE: per choice a role chunk first, then content chunks, the
finish_reason on each choice's last chunk, a usage chunk (``choices: []``) when
``stream_options.include_usage``, then ``data: [DONE]``. An error mid-stream is one event
in OpenAI error shape, after which the stream closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from vtllm.frontend.generation import ChoiceJob, ChoiceMerger, collect
from vtllm.frontend.logprobs import chat_logprobs
from vtllm.frontend.openai_types import ChatCompletionRequest, bad_request, decode_body
from vtllm.frontend.sampling import (
    build_sampling_params,
    check_prompt_fits,
    choice_seed,
    explicit_max_tokens,
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


def _check_supported(request: ChatCompletionRequest) -> None:
    if not request.messages:
        raise bad_request("messages must contain at least one message", "messages")
    fmt = (request.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(
            f"response_format type {fmt!r} is not supported (no constrained decoding); use 'text'",
            "response_format",
        )
    choice = request.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise bad_request(
            "tool_choice may be 'auto' or 'none' (forced tool calls are not supported)",
            "tool_choice",
        )


def _prompt_token_ids(ctx: ServingContext, request: ChatCompletionRequest) -> list[int]:
    tools = None if request.tool_choice == "none" else request.tools
    try:
        text = ctx.tokenizer.render_chat(
            [message.to_template_dict() for message in request.messages],
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=tools,
            chat_template_kwargs=request.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    # The template writes the special tokens (BOS included) itself.
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def build_chat_jobs(
    ctx: ServingContext, request: ChatCompletionRequest, response_id: str
) -> list[ChoiceJob]:
    """Validate the request and turn it into one engine request per choice."""
    _check_supported(request)
    prompt_ids = _prompt_token_ids(ctx, request)
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
                ctx.extra_stop_token_ids,
                logprobs,
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
    response_id = new_id("chatcmpl")
    jobs = build_chat_jobs(ctx, request, response_id)
    if request.stream:
        return StreamingResponse(
            _stream(ctx, request, jobs, response_id),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    result = await unless_disconnected(_complete(ctx, request, jobs, response_id), is_disconnected)
    return json_response(result)


async def _complete(
    ctx: ServingContext, request: ChatCompletionRequest, jobs: list[ChoiceJob], response_id: str
) -> dict[str, Any]:
    usage = UsageCounter(len(jobs[0].prompt_token_ids))
    async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs) as merger:
        by_index = await collect(merger)
    choices = []
    for job in jobs:
        deltas = by_index.get(job.index, [])
        for delta in deltas:
            usage.add(delta)
        entries = [entry for delta in deltas for entry in delta.logprobs]
        choices.append(
            {
                "index": job.index,
                "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                "logprobs": chat_logprobs(ctx.tokenizer, entries) if request.logprobs else None,
                "finish_reason": deltas[-1].finish_reason if deltas else "abort",
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
    ctx: ServingContext, request: ChatCompletionRequest, jobs: list[ChoiceJob], response_id: str
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
    try:
        async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs) as merger:
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
                if not item.text and item.finish_reason is None and not item.logprobs:
                    continue
                logprobs = chat_logprobs(ctx.tokenizer, item.logprobs) if request.logprobs else None
                delta = {"content": item.text} if item.text else {}
                yield chunk(
                    [
                        {
                            "index": item.index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": item.finish_reason,
                        }
                    ]
                )
        if request.include_usage:
            yield chunk([], usage=usage.to_dict())
        yield SSE_DONE
    except Exception as e:
        yield sse_error(e)
