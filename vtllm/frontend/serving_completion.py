"""``POST /v1/completions``: prompt(s) → token ids → choices (n per prompt).

Choice ``prompt_idx * n + i`` is sample ``i`` of prompt ``prompt_idx``. ``echo`` puts the
prompt text in front of each choice's text (the first chunk, when streaming).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from vtllm.frontend.generation import ChoiceJob, ChoiceMerger, collect
from vtllm.frontend.logprobs import completion_logprobs
from vtllm.frontend.openai_types import CompletionRequest, bad_request, decode_body
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


def _check_supported(ctx: ServingContext, request: CompletionRequest) -> None:
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    check_token_ids(request.stop_token_ids or [], ctx.vocab_size, "stop_token_ids")


def _tokenize(ctx: ServingContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), ctx.tokenizer.max_chars_per_token, ctx.max_model_len)
        return ctx.tokenizer.encode(prompt, add_special_tokens=True)
    check_token_ids(prompt, ctx.vocab_size)
    return prompt


def build_completion_jobs(
    ctx: ServingContext, request: CompletionRequest, response_id: str
) -> tuple[list[ChoiceJob], list[str]]:
    """Validate and fan out: one engine request per (prompt, sample). Also returns each
    prompt's text (for ``echo``)."""
    _check_supported(ctx, request)
    prompts = request.prompts()
    ctx.check_num_choices(len(prompts), request.n)
    requested = explicit_max_tokens(request.max_tokens)
    logprobs = request.logprobs
    logit_bias = parse_logit_bias(request.logit_bias, ctx.vocab_size)
    jobs, prompt_texts = [], []
    for prompt_idx, prompt in enumerate(prompts):
        prompt_ids = _tokenize(ctx, prompt)
        check_prompt_fits(len(prompt_ids), requested, ctx.max_model_len)
        max_tokens = resolve_max_tokens(
            request.max_tokens, ctx.default_max_tokens, len(prompt_ids), ctx.max_model_len
        )
        prompt_texts.append(prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt))
        for i in range(request.n):
            index = prompt_idx * request.n + i
            params = build_sampling_params(
                request,
                max_tokens,
                choice_seed(request.seed, i),
                logprobs,
                logit_bias,
            )
            params.structured_output = structured_output_spec(request)  # 400 if malformed
            jobs.append(
                ChoiceJob(
                    index,
                    f"{response_id}-{index}",
                    prompt_ids,
                    params,
                    request.stop_strings,
                    request.priority,
                    request.cache_salt,
                )
            )
    return jobs, prompt_texts


def _num_prompt_tokens(request: CompletionRequest, jobs: list[ChoiceJob]) -> int:
    return sum(len(job.prompt_token_ids) for job in jobs[:: request.n])


async def create_completion(
    ctx: ServingContext, body: bytes, is_disconnected: Callable[[], Awaitable[bool]]
) -> Response:
    request = decode_body(body, CompletionRequest)
    ctx.check_model(request.model)
    response_id = new_id("cmpl")
    jobs, prompt_texts = await ctx.off_loop(
        len(body), build_completion_jobs, ctx, request, response_id
    )
    if request.stream:
        return StreamingResponse(
            _stream(ctx, request, jobs, prompt_texts, response_id),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    result = await unless_disconnected(
        _complete(ctx, request, jobs, prompt_texts, response_id), is_disconnected
    )
    return json_response(result)


async def _complete(
    ctx: ServingContext,
    request: CompletionRequest,
    jobs: list[ChoiceJob],
    prompt_texts: list[str],
    response_id: str,
) -> dict[str, Any]:
    usage = UsageCounter(_num_prompt_tokens(request, jobs))
    async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs, ctx.drain) as merger:
        by_index = await collect(merger)
    choices = []
    for job in jobs:
        deltas = by_index.get(job.index, [])
        for delta in deltas:
            usage.add(delta)
        prefix = prompt_texts[job.index // request.n] if request.echo else ""
        entries = [entry for delta in deltas for entry in delta.logprobs]
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(ctx.tokenizer, entries, len(prefix))
        choices.append(
            {
                "index": job.index,
                "text": prefix + "".join(d.text for d in deltas),
                "logprobs": logprobs,
                "finish_reason": deltas[-1].finish_reason if deltas else "abort",
            }
        )
    return {
        "id": response_id,
        "object": "text_completion",
        "created": now_s(),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage.to_dict(),
    }


async def _stream(
    ctx: ServingContext,
    request: CompletionRequest,
    jobs: list[ChoiceJob],
    prompt_texts: list[str],
    response_id: str,
) -> AsyncIterator[bytes]:
    created = now_s()

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_event(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": ctx.model_name,
                "choices": choices,
                **extra,
            }
        )

    usage = UsageCounter(_num_prompt_tokens(request, jobs))
    text_offsets = {job.index: 0 for job in jobs}
    try:
        async with ChoiceMerger(ctx.engine, ctx.tokenizer, jobs, ctx.drain) as merger:
            if request.echo:
                for job in jobs:
                    text = prompt_texts[job.index // request.n]
                    text_offsets[job.index] = len(text)
                    yield chunk(
                        [
                            {
                                "index": job.index,
                                "text": text,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
            async for batch in delta_batches(merger):
                if batch is KEEPALIVE:
                    yield SSE_KEEPALIVE
                    continue
                events = []
                for item in batch:
                    usage.add(item)
                    if not item.text and item.finish_reason is None and not item.logprobs:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = completion_logprobs(
                            ctx.tokenizer, item.logprobs, text_offsets[item.index]
                        )
                    text_offsets[item.index] += len(item.text)
                    events.append(
                        chunk(
                            [
                                {
                                    "index": item.index,
                                    "text": item.text,
                                    "logprobs": logprobs,
                                    "finish_reason": item.finish_reason,
                                }
                            ]
                        )
                    )
                if events:
                    yield b"".join(events)
        if request.include_usage:
            yield chunk([], usage=usage.to_dict())
        yield SSE_DONE
    except Exception as e:
        yield sse_error(e)
