"""``POST /v1/embeddings`` (OpenAI's shape): a decoder model's pooled final hidden states.

``input`` is a string, a list of strings, a list of token ids, or a list of such lists;
each becomes one engine request with ``SamplingParams.pooling`` (``--pooling-type``:
``last``, the last prompt token's state, as Qwen3-Embedding; or ``mean``) and
``max_tokens=1`` (the one sampled token is discarded). Vectors are L2-normalised and sent
as floats or, with ``encoding_format: "base64"``, as base64 of little-endian float32 (as
OpenAI does). ``usage`` counts the prompt tokens. Mean-pooled requests get a unique cache
salt: their whole prompt must be computed, never taken from the prefix cache.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
from starlette.responses import Response

from vtllm.frontend.generation import GenerationError
from vtllm.frontend.openai_types import bad_request, decode_body
from vtllm.frontend.sampling import check_token_ids
from vtllm.frontend.serving_context import ServingContext, json_response, new_id
from vtllm.protocol import messages as m

MAX_INPUTS = 2048  # as OpenAI: at most 2048 inputs in one request

POOLING_TYPES = {"last": m.PoolingType.LAST, "mean": m.PoolingType.MEAN}


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=False):
    input: str | list[Any]  # checked by _prompts: strings, token ids, or lists of ids
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def normalized(vector: list[float]) -> list[float]:
    """``vector / ||vector||_2`` (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """Floats, or base64 of little-endian float32 (what OpenAI's SDK decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _prompts(ctx: ServingContext, request: EmbeddingRequest) -> list[list[int]]:
    raw = request.input
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        items = [raw]  # one prompt of token ids
    else:
        items = list(raw)
    for item in items:
        is_ids = isinstance(item, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in item
        )
        if not (isinstance(item, str) or is_ids):
            raise bad_request(
                "input must be a string, a list of strings, a list of token ids, or a list "
                "of lists of token ids",
                "input",
            )
    if not items or len(items) > MAX_INPUTS:
        raise bad_request(f"input must hold 1 to {MAX_INPUTS} items, got {len(items)}", "input")
    prompts = []
    for item in items:
        ids = ctx.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise bad_request("input has an empty item", "input")
        check_token_ids(ids, ctx.vocab_size, "input")
        if len(ids) >= ctx.max_model_len:
            raise bad_request(
                f"an input has {len(ids)} tokens; this model takes at most {ctx.max_model_len - 1}",
                "input",
            )
        prompts.append(ids)
    return prompts


async def _embed(ctx: ServingContext, request_id: str, ids: list[int]) -> list[float]:
    kind = ctx.pooling_type
    params = m.SamplingParams(temperature=0.0, max_tokens=1, pooling=kind)
    salt = uuid.uuid4().hex if kind == m.PoolingType.MEAN else None
    embedding = None
    async for output in ctx.engine.generate(request_id, ids, params, cache_salt=salt):
        if output.embedding is not None:
            embedding = output.embedding
        if output.finish_reason == m.FinishReason.ERROR:
            raise GenerationError(
                output.error or "the engine failed on this input",
                output.error_code,
                output.error_param,
            )
    if embedding is None:
        raise GenerationError(
            "the engine returned no embedding for an input (preempted mid-prompt); retry",
            m.ErrorCode.UNAVAILABLE,
        )
    return embedding


async def create_embedding(
    ctx: ServingContext, body: bytes, is_disconnected: Callable[[], Awaitable[bool]]
) -> Response:
    request = decode_body(body, EmbeddingRequest)
    ctx.check_model(request.model)
    if request.dimensions is not None:
        raise bad_request("dimensions is not supported: vectors have the model's width")
    prompts = await ctx.off_loop(len(body), _prompts, ctx, request)
    response_id = new_id("embd")
    vectors = await asyncio.gather(
        *(_embed(ctx, f"{response_id}-{i}", ids) for i, ids in enumerate(prompts))
    )
    num_tokens = sum(len(ids) for ids in prompts)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": encode_vector(normalized(vector), request.encoding_format),
        }
        for i, vector in enumerate(vectors)
    ]
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": ctx.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )
