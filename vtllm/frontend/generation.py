"""Engine requests → text deltas, shared by the chat and completion endpoints.

One HTTP request fans out into *choices* (n per prompt), each its own engine request.
``run_choice`` turns one engine request's outputs into ``ChoiceDelta``s (detokenized, stop
strings cut; leaving early aborts the engine request). ``ChoiceMerger`` runs all choices
of an HTTP request at once and hands their deltas out through one queue, with a timed
``get`` so a stream can send keepalives while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from vtllm.frontend.detokenizer import OutputText
from vtllm.frontend.drain import Drain
from vtllm.frontend.openai_types import OpenAIError
from vtllm.frontend.tokenizer import ModelTokenizer
from vtllm.protocol.async_client import EngineClient, EngineDeadError
from vtllm.protocol.messages import ErrorCode, FinishReason, SamplingParams


class GenerationError(RuntimeError):
    """The engine ended a request with FinishReason.ERROR; ``code`` and ``param`` are its
    output's ``error_code`` and ``error_param`` (None from an engine that sends none)."""

    def __init__(
        self, message: str, code: ErrorCode | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class ChoiceJob:
    """One engine request: choice ``index`` of the HTTP response."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop: list[str]
    priority: int = 0
    cache_salt: str | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    """New text of one choice; ``finish_reason`` set on its last delta."""

    index: int
    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


def _logprobs_of(output) -> list[TokenLogprob]:
    if output.new_logprobs is None:
        return []
    tops = output.new_top_logprobs or [[] for _ in output.new_logprobs]
    return [
        TokenLogprob(t, lp, list(top))
        for t, lp, top in zip(output.new_token_ids, output.new_logprobs, tops, strict=False)
    ]


async def run_choice(
    engine: EngineClient, tokenizer: ModelTokenizer, job: ChoiceJob
) -> AsyncIterator[ChoiceDelta]:
    """Deltas of one choice until it finishes. A stop string ends it with "stop" and
    aborts the engine request. Raises GenerationError or EngineDeadError."""
    text = OutputText(tokenizer.decode, job.prompt_token_ids, job.stop)
    outputs = engine.generate(
        job.request_id,
        job.prompt_token_ids,
        job.sampling_params,
        priority=job.priority,
        cache_salt=job.cache_salt,
    )
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            if output.finish_reason == FinishReason.ERROR:
                raise GenerationError(
                    output.error or "the engine failed this request",
                    output.error_code,
                    output.error_param,
                )
            delta = text.push(output.new_token_ids, output.stop_token_id)
            finish: str | None = None
            if text.stopped_by_string:
                finish = "stop"  # leaving the loop aborts the engine request
                engine.set_finish_reason(job.request_id, finish)
            elif output.finish_reason is not None:
                delta += text.finish()
                finish = output.finish_reason.openai_name
            if delta or finish or output.new_logprobs:
                yield ChoiceDelta(
                    job.index,
                    delta,
                    len(output.new_token_ids),
                    finish,
                    output.num_prompt_tokens or len(job.prompt_token_ids),
                    output.num_cached_tokens,
                    _logprobs_of(output),
                )
            elif output.new_token_ids:
                # tokens whose text is held back still count toward usage
                yield ChoiceDelta(job.index, "", len(output.new_token_ids))
            if finish is not None:
                return


class _Done:
    pass


_DONE = _Done()


class ChoiceMerger:
    """Runs every choice concurrently. ``async with`` it; call ``get(timeout)`` until it
    returns None (all done): a ``ChoiceDelta``, or ``asyncio.TimeoutError`` when nothing arrived in
    ``timeout`` seconds (the merger keeps running). ``get_batch(timeout)`` is the same but
    returns every delta that is ready at once (an empty list: all done), so a stream that
    fell behind writes them in one go. Errors of a choice, and the exception given to
    ``interrupt``, are re-raised by ``get`` (after the deltas that came before them).
    Leaving the block cancels (and so aborts) unfinished choices. With a ``drain``, the
    merger is registered with it while open, so a stopping server can interrupt it."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: ModelTokenizer,
        jobs: Sequence[ChoiceJob],
        drain: Drain | None = None,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._jobs = list(jobs)
        self._drain = drain
        # a deque and one waiter, not an asyncio.Queue: a timed wait then costs a timer,
        # not the task that asyncio.wait_for wraps around Queue.get (once per token)
        self._items: deque[ChoiceDelta | BaseException | _Done] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._num_running = 0

    async def __aenter__(self) -> ChoiceMerger:
        if not self._engine.is_alive:
            raise EngineDeadError(self._engine.dead_reason or "engine core is not connected")
        if self._drain is not None:
            self._drain.add(self)
        self._num_running = len(self._jobs)
        self._tasks = [asyncio.create_task(self._pump(job)) for job in self._jobs]
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Cancelling a choice closes its engine stream, which aborts the engine request.
        if self._drain is not None:
            self._drain.discard(self)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def interrupt(self, exc: BaseException) -> None:
        """Make the next ``get`` raise ``exc`` (the choices keep running until the block
        is left)."""
        self._put(exc)

    def _put(self, item: ChoiceDelta | BaseException | _Done) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _pump(self, job: ChoiceJob) -> None:
        try:
            async for delta in run_choice(self._engine, self._tokenizer, job):
                self._put(delta)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._put(e)
        finally:
            self._put(_DONE)

    async def _wait(self, timeout: float | None) -> None:
        """Until an item is queued; TimeoutError after ``timeout`` seconds without one."""
        if self._items:
            return
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, lambda: waiter.done() or waiter.set_result(None))
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if not self._items:
            raise asyncio.TimeoutError

    async def get(self, timeout: float | None = None) -> ChoiceDelta | None:
        while self._num_running > 0:
            await self._wait(timeout)
            item = self._items.popleft()
            if isinstance(item, _Done):
                self._num_running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        return None

    async def get_batch(self, timeout: float | None = None) -> list[ChoiceDelta]:
        batch: list[ChoiceDelta] = []
        while self._num_running > 0 and not batch:
            await self._wait(timeout)
            while self._items:
                item = self._items.popleft()
                if isinstance(item, _Done):
                    self._num_running -= 1
                elif isinstance(item, BaseException):
                    if batch:  # the deltas before it go out first
                        self._items.appendleft(item)
                        return batch
                    raise item
                else:
                    batch.append(item)
        return batch


async def collect(merger: ChoiceMerger) -> dict[int, list[ChoiceDelta]]:
    """Every delta, grouped by choice index (non-streaming responses)."""
    by_index: dict[int, list[ChoiceDelta]] = {}
    while (delta := await merger.get()) is not None:
        by_index.setdefault(delta.index, []).append(delta)
    return by_index


def error_for(exc: BaseException) -> OpenAIError:
    """The OpenAI error for a failure during generation."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"engine core is not available: {exc}", "service_unavailable")
    if isinstance(exc, GenerationError) and exc.code == ErrorCode.INVALID_REQUEST:
        return OpenAIError(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, GenerationError) and exc.code == ErrorCode.UNAVAILABLE:
        return OpenAIError(503, str(exc), "service_unavailable")
    if isinstance(exc, GenerationError):
        return OpenAIError(500, f"generation failed: {exc}", "internal_server_error")
    return OpenAIError(500, f"internal error: {exc!r}", "internal_server_error")
