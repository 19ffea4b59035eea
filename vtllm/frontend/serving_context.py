"""What every endpoint needs to serve: tokenizer, engine client and the engine's limits.

Also the pieces both endpoints share: the model-name check, usage accounting, and
waiting for a non-streaming result while watching for a client disconnect.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response

from vtllm.frontend.drain import Drain
from vtllm.frontend.generation import ChoiceDelta
from vtllm.frontend.openai_types import OpenAIError, clip
from vtllm.frontend.tokenizer import ModelTokenizer
from vtllm.protocol.async_client import EngineClient
from vtllm.protocol.messages import PoolingType

T = TypeVar("T")

_DISCONNECT_POLL_S = 0.5
# Request bodies below this size are templated and tokenized on the event loop: a thread
# hop costs ~0.15 ms here, tokenizing ~0.5 us a character, so ~2 KiB costs about 1 ms.
INLINE_CPU_MAX_BYTES = 2048


@dataclass
class ServingContext:
    tokenizer: ModelTokenizer
    engine: EngineClient
    model_name: str
    max_model_len: int
    vocab_size: int
    default_max_tokens: int | None = None
    model_aliases: tuple[str, ...] = ()
    tool_call_parser: str | None = None  # --tool-call-parser, or detected from the template
    reasoning_parser: str | None = None  # --reasoning-parser
    response_role: str = "assistant"  # --response-role: the role of generated chat messages
    pooling_type: PoolingType = PoolingType.LAST  # --pooling-type (/v1/embeddings)
    max_choices_per_request: int = 256  # --max-choices-per-request
    drain: Drain = field(default_factory=Drain)  # graceful stop (drain.py)

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: CPU work for an input of ``size`` bytes (templating, tokenizing,
        detokenizing), on a worker thread unless it is small enough to run inline. The
        tokenizer releases the GIL, so the event loop keeps serving other streams."""
        if size < INLINE_CPU_MAX_BYTES:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def check_num_choices(self, num_prompts: int, n: int) -> None:
        """Refuse (400) a request that would become more than --max-choices-per-request
        engine requests: checked before any prompt is tokenized."""
        if num_prompts * n <= self.max_choices_per_request:
            return
        what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise OpenAIError(
            400,
            f"{what} asks for {num_prompts * n} choices; at most "
            f"{self.max_choices_per_request} per request (send fewer prompts or a smaller n, "
            "or raise --max-choices-per-request)",
            param="n",
            code="too_many_choices",
        )

    def check_model(self, requested: str | None) -> None:
        """None or a served name is fine; anything else is a 404."""
        if requested is None or requested == self.model_name or requested in self.model_aliases:
            return
        raise OpenAIError(
            404,
            f"the model {clip(requested)!r} does not exist; this server serves {self.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


_json = msgspec.json.Encoder()


def json_response(content: Any, status_code: int = 200) -> Response:
    """JSON via msgspec: non-finite floats (a -inf logprob) become null instead of
    failing the response."""
    return Response(_json.encode(content), status_code, media_type="application/json")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class UsageCounter:
    """Token usage of one HTTP response: prompt tokens once per prompt, completion tokens
    summed over every choice."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self._cached_by_index: dict[int, int] = {}

    def add(self, delta: ChoiceDelta) -> None:
        self.num_completion_tokens += delta.num_new_tokens
        if delta.num_cached_tokens:
            self._cached_by_index[delta.index] = delta.num_cached_tokens

    def to_dict(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
        }
        if self._cached_by_index:
            usage["prompt_tokens_details"] = {"cached_tokens": max(self._cached_by_index.values())}
        return usage


async def unless_disconnected(
    work: Awaitable[T], is_disconnected: Callable[[], Awaitable[bool]]
) -> T:
    """Await ``work``; if the client goes away first, cancel it (which aborts its engine
    requests) and raise OpenAIError(499)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise OpenAIError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
