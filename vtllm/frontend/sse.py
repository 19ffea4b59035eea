"""Server-sent events: the wire format and the keepalive-aware delta stream.

Events are ``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. Whenever a
stream has been silent for ``VT_SSE_KEEPALIVE_S`` seconds (0 = off) — queued, in a long
prefill, or stalled later (recompute after preemption, a slow step) — a ``: keepalive``
comment goes out, so proxies with idle timeouts do not cut it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from vtllm import envs
from vtllm.frontend.drain import ServerStopping
from vtllm.frontend.generation import ChoiceDelta, ChoiceMerger, error_for

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keepalive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_json = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


class KeepAlive:
    """Marker yielded by ``delta_batches`` when a keepalive comment is due."""


KEEPALIVE = KeepAlive()


async def delta_batches(
    merger: ChoiceMerger, keepalive_s: float | None = None
) -> AsyncIterator[list[ChoiceDelta] | KeepAlive]:
    """The merger's deltas, as the lists that were ready together (a stream writes each
    list at once: one write per wake-up, however many tokens arrived meanwhile), and
    ``KEEPALIVE`` after every ``keepalive_s`` seconds without one, before the first
    delta or between any two (default ``VT_SSE_KEEPALIVE_S``; <= 0 = no keepalives)."""
    if keepalive_s is None:
        keepalive_s = envs.VT_SSE_KEEPALIVE_S
    timeout = keepalive_s if keepalive_s > 0 else None
    while True:
        try:
            batch = await merger.get_batch(timeout=timeout)
        except asyncio.TimeoutError:
            yield KEEPALIVE
            continue
        if not batch:
            return
        yield batch


def sse_error(exc: BaseException) -> bytes:
    """The end of a failed stream: one event in OpenAI error shape, then ``[DONE]`` (a
    client reading until ``[DONE]`` is never left with a cut connection)."""
    error = error_for(exc)
    if isinstance(exc, ServerStopping):
        logger.warning("stream ended: %s", error.message)
    elif error.status_code >= 500:
        logger.error("stream failed: %s", error.message)
    return sse_event(error.to_dict()) + SSE_DONE
