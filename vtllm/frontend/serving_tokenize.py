"""``POST /tokenize`` and ``POST /detokenize`` (vLLM-compatible shapes).

Both need the API key when one is set. ``/tokenize`` takes ``{"prompt": "..."}`` (tokenized as ``/v1/completions`` does) or
``{"messages": [...]}`` (rendered and tokenized as ``/v1/chat/completions`` does) and
answers ``{"tokens", "count", "max_model_len"}`` (plus ``token_strs`` when asked), so a
client can check what fits before it sends. ``/detokenize`` takes ``{"tokens": [...]}``
and answers ``{"prompt": "..."}`` (special tokens kept, so the two round-trip).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.responses import Response

from vtllm.frontend.openai_types import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bad_request,
    decode_body,
)
from vtllm.frontend.sampling import check_token_ids
from vtllm.frontend.serving_chat import chat_prompt_token_ids
from vtllm.frontend.serving_context import ServingContext, json_response


def _tokenize_request(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body has ``messages`` (a chat) or else a ``prompt``: decode it as that."""
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw]).keys()
    except (msgspec.ValidationError, msgspec.DecodeError):
        keys = set()  # decode_body below says what is wrong
    if "messages" in keys:
        return decode_body(body, TokenizeChatRequest)
    return decode_body(body, TokenizeCompletionRequest)


async def tokenize(
    ctx: ServingContext, body: bytes, is_disconnected: Callable[[], Awaitable[bool]]
) -> Response:
    request = _tokenize_request(body)
    ctx.check_model(request.model)
    if isinstance(request, TokenizeChatRequest):
        if "prompt" in msgspec.json.decode(body, type=dict[str, msgspec.Raw]):
            raise bad_request("send either prompt or messages, not both", "prompt")
        tokens = await ctx.off_loop(
            len(body),
            chat_prompt_token_ids,
            ctx,
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.tools,
            request.chat_template_kwargs,
            request.add_special_tokens,
        )
    else:
        tokens = await ctx.off_loop(
            len(body), ctx.tokenizer.encode, request.prompt, request.add_special_tokens
        )
    result: dict[str, Any] = {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": ctx.max_model_len,
    }
    if request.return_token_strs:
        # the vocabulary's own token strings, as transformers' convert_ids_to_tokens
        result["token_strs"] = [ctx.tokenizer.tokenizer.id_to_token(t) or "" for t in tokens]
    return json_response(result)


async def detokenize(
    ctx: ServingContext, body: bytes, is_disconnected: Callable[[], Awaitable[bool]]
) -> Response:
    request = decode_body(body, DetokenizeRequest)
    ctx.check_model(request.model)
    check_token_ids(request.tokens, ctx.vocab_size, "tokens")
    # special tokens kept, so that tokenize → detokenize gives the text back
    prompt = await ctx.off_loop(len(body), ctx.tokenizer.decode, request.tokens, False)
    return json_response({"prompt": prompt})
