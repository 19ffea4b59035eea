"""asyncio client of the engine core.

The socket belongs to a ``session.SessionThread``: it handshakes, heartbeats every
``VT_HEARTBEAT_INTERVAL_S`` and watches the engine's liveness (``VT_HEARTBEAT_TIMEOUT_S``
of silence, ``EngineDead``, the optional ``engine_alive`` probe) whatever this event loop is
doing, so a loop blocked for a minute keeps its session. Its events reach the loop through
``call_soon_threadsafe``: ``EngineOutputs`` are routed by request id into per-request
queues, ``UtilityResponse`` into futures.

When a session is lost, every in-flight request ends with ``EngineDeadError`` (the engine
no longer has it). Then either the engine is dead for good (``on_dead(reason)`` fires once)
or, with ``reconnect`` or after ``SessionUnknown``, the client says Hello again and serves
new requests once the engine answers; meanwhile ``is_alive`` is False and ``dead_reason``
says why.

Framing: the client sends one frame per message; of a received multipart message only the
last frame is decoded (so an engine core that adds an empty delimiter frame also works).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec

from vtllm import envs
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m
from vtllm.protocol.session import (
    EngineDeadError,
    Event,
    FrameTooLargeError,
    HandshakeError,
    HandshakeFailed,
    SessionLost,
    SessionThread,
    SessionUp,
)

__all__ = [
    "EngineClient",
    "EngineDeadError",
    "FrameTooLargeError",
    "HandshakeError",
    "RequestObserver",
    "UtilityError",
    "merge_outputs",
]

logger = logging.getLogger(__name__)


class UtilityError(RuntimeError):
    """A utility call the engine core answered with ``ok=False``."""


class RequestObserver(Protocol):
    """Watches requests as the engine client routes them (metrics). Called on the event
    loop, with ``time.monotonic()`` times; an exception is logged, never propagated."""

    def on_request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        """A request is about to be sent to the engine core."""

    def on_outputs(self, message: m.EngineOutputs, now: float) -> None:
        """An ``EngineOutputs`` batch arrived (before its outputs are routed)."""

    def on_request_done(self, request_id: str, finish_reason: str, now: float) -> None:
        """The request's consumer is done with it. ``finish_reason`` is the engine's
        (stop, length, abort, error), "abort" when the consumer left early, "error" when
        the engine died, or what the consumer set with ``set_finish_reason``."""


def merge_outputs(first: m.RequestOutput, second: m.RequestOutput) -> m.RequestOutput:
    """One output standing for two consecutive outputs of a request: the tokens (and
    their logprobs) of both, in order; the end (finish reason, stop token, error) of the
    second; what only a first output carries (prompt counts, engine timings, an
    embedding) from whichever has it."""

    def joined(a: list | None, b: list | None) -> list | None:
        return None if a is None and b is None else [*(a or ()), *(b or ())]

    return msgspec.structs.replace(
        second,
        new_token_ids=[*first.new_token_ids, *second.new_token_ids],
        new_logprobs=joined(first.new_logprobs, second.new_logprobs),
        new_top_logprobs=joined(first.new_top_logprobs, second.new_top_logprobs),
        num_prompt_tokens=first.num_prompt_tokens or second.num_prompt_tokens,
        num_cached_tokens=first.num_cached_tokens or second.num_cached_tokens,
        queue_time_s=first.queue_time_s if first.queue_time_s is not None else second.queue_time_s,
        prefill_time_s=first.prefill_time_s
        if first.prefill_time_s is not None
        else second.prefill_time_s,
        embedding=first.embedding if first.embedding is not None else second.embedding,
    )


class _Dead:
    """Queue item telling a request's consumer that the engine died."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class EngineClient:
    """Use: ``await connect(...)``, then ``generate``/``abort``/``utility``, then
    ``close``. All methods run on one event loop."""

    def __init__(self) -> None:
        self.ready: m.Ready | None = None  # the engine's answer to the latest handshake
        self.latest_stats: m.SchedulerStats | None = None
        # why the engine is not available now (None while serving)
        self.dead_reason: str | None = None
        self._session: SessionThread | None = None
        self._epoch = 0
        self._handshake: asyncio.Future[m.Ready] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[m.RequestOutput | _Dead]] = {}
        self._utility_calls: dict[int, asyncio.Future[m.UtilityResponse]] = {}
        self._call_ids = itertools.count(1)
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._on_dead: Callable[[str], Any] | None = None
        self._final = False
        self._closed = False
        self._observers: list[RequestObserver] = []
        self._finish_reasons: dict[str, str] = {}  # set by consumers that end a request

    @property
    def is_alive(self) -> bool:
        return self.ready is not None and self.dead_reason is None and not self._closed

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def add_observer(self, observer: RequestObserver) -> None:
        self._observers.append(observer)

    # -- lifecycle ---------------------------------------------------------------------

    async def connect(
        self,
        address: str,
        client_name: str,
        engine_alive: Callable[[], bool] | None = None,
        on_dead: Callable[[str], Any] | None = None,
        timeout_s: float | None = None,
        curve_keys: transport.ClientKeys | None = None,
        reconnect: bool = False,
    ) -> m.Ready:
        """Connect and handshake. Returns the engine's ``Ready``; raises HandshakeError on
        refusal, on a timeout (default: worker start timeout + heartbeat timeout), or when
        ``engine_alive`` turns false while waiting. ``curve_keys``: this client's key
        file (``transport.ClientKeys.load``, from ``vtllm keygen client``) when the engine
        listens on a CurveZMQ-secured tcp:// address. ``generate`` raises
        ``FrameTooLargeError`` for a request longer than the engine reads.

        ``reconnect``: losing the engine (silence, ``EngineDead``) is not final: in-flight
        requests fail, and the client handshakes again when an engine core answers at
        ``address`` (a remote engine restarted). Without it such a loss is final and
        ``on_dead(reason)`` fires (a local engine core: its supervisor restarts everything).
        Set it only without an ``engine_alive`` probe, whose ``False`` is always final."""
        if timeout_s is None:
            timeout_s = envs.VT_WORKER_START_TIMEOUT_S + envs.VT_HEARTBEAT_TIMEOUT_S
        self._on_dead = on_dead
        self._loop = asyncio.get_running_loop()
        self._handshake = self._loop.create_future()
        self._session = SessionThread(
            address,
            client_name,
            self._emit_threadsafe,
            curve_keys=curve_keys,
            engine_alive=engine_alive,
            reconnect=reconnect,
        )
        self._session.start()
        try:
            await asyncio.wait_for(asyncio.shield(self._handshake), timeout_s)
        except TimeoutError:
            await self._stop_session()
            raise HandshakeError(
                f"engine core at {address} did not answer the handshake within {timeout_s:.0f}s"
            ) from None
        except BaseException:  # refused, or the caller gave up (cancelled)
            await self._stop_session()
            raise
        assert self.ready is not None
        return self.ready

    async def close(self) -> None:
        """Say ``Goodbye`` (the engine aborts what this client still owns) and stop."""
        if self._closed:
            return
        if self.is_alive:
            self._send(m.Goodbye())
        self._closed = True
        for task in self._side_tasks:
            task.cancel()
        for task in list(self._side_tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._fail_all("frontend is shutting down")
        await self._stop_session()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: m.SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[m.RequestOutput]:
        """Add a request and yield its outputs until one carries a finish reason. Outputs
        that arrived while the consumer was busy come merged into one (``merge_outputs``).

        Raises EngineDeadError if the engine is (or becomes) dead. If the consumer stops
        early (break, cancellation, client disconnect) the request is aborted in the engine.
        """
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[m.RequestOutput | _Dead] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        finish_reason = "abort"  # unless the engine or the consumer says otherwise
        self._notify("on_request_added", request_id, len(prompt_token_ids), time.monotonic())
        try:
            self._send(
                m.AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=sampling_params,
                    arrival_time=time.time(),
                    priority=priority,
                    cache_salt=cache_salt,
                )
            )
            dead: _Dead | None = None
            while not finished:
                item = dead or await queue.get()
                if isinstance(item, _Dead):
                    finished = True
                    finish_reason = "error"
                    raise EngineDeadError(item.reason)
                # a consumer that fell behind takes every output queued meanwhile at once:
                # its per-output work (detokenizing, an SSE write) is paid once, not per step
                while item.finish_reason is None and not queue.empty():
                    following = queue.get_nowait()
                    if isinstance(following, _Dead):
                        dead = following  # after what arrived before it
                        break
                    item = merge_outputs(item, following)
                finished = item.finish_reason is not None
                if item.finish_reason is not None:
                    finish_reason = item.finish_reason.openai_name
                yield item
        except EngineDeadError:
            finish_reason = "error"
            raise
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.is_alive:
                self._abort_soon([request_id])
            finish_reason = self._finish_reasons.pop(request_id, finish_reason)
            self._notify("on_request_done", request_id, finish_reason, time.monotonic())

    def set_finish_reason(self, request_id: str, finish_reason: str) -> None:
        """The consumer is about to end an in-flight request itself (a stop string
        matched in the frontend): observers see ``finish_reason`` instead of "abort"."""
        if request_id in self._queues:
            self._finish_reasons[request_id] = finish_reason

    def output_queue(self, request_id: str) -> asyncio.Queue[m.RequestOutput | _Dead] | None:
        return self._queues.get(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine; their consumers see no more outputs."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if request_ids and self.is_alive:
            self._send(m.AbortRequests(request_ids=list(request_ids)))

    async def utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method`` in the engine core; returns its decoded result. Raises
        UtilityError, EngineDeadError or TimeoutError."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future[m.UtilityResponse] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            raw_args = [msgspec.Raw(codec.encode_value(a)) for a in args]
            self._send(m.UtilityRequest(call_id=call_id, method=method, args=raw_args))
            response = await asyncio.wait_for(future, timeout)
        finally:
            self._utility_calls.pop(call_id, None)
        if not response.ok:
            raise UtilityError(f"{method}: {response.error}")
        return codec.decode_value(response.result)

    # -- internals ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.ready is None or self._closed:
            raise EngineDeadError("not connected to an engine core")

    def _abort_soon(self, request_ids: list[str]) -> None:
        """Abort from a ``finally`` that may run inside a cancellation: a separate task."""
        task = asyncio.get_running_loop().create_task(self.abort(request_ids))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _send(self, message: msgspec.Struct) -> None:
        """Hand ``message`` to the session thread (never blocks). A message of a session
        that is gone meanwhile is dropped there; its requests fail through ``SessionLost``."""
        assert self._session is not None
        self._session.send(message, self._epoch)

    def _emit_threadsafe(self, event: Event) -> None:
        """Called on the session thread: run ``_on_event`` on the loop."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self._on_event, event)

    def _on_event(self, event: Event) -> None:
        if self._closed:
            return
        if isinstance(event, m.EngineOutputs):
            self._on_outputs(event)
        elif isinstance(event, m.UtilityResponse):
            future = self._utility_calls.get(event.call_id)
            if future is not None and not future.done():
                future.set_result(event)
        elif isinstance(event, SessionUp):
            self._on_session_up(event)
        elif isinstance(event, SessionLost):
            self._on_session_lost(event)
        elif (
            isinstance(event, HandshakeFailed)
            and self._handshake is not None
            and not self._handshake.done()
        ):
            self._handshake.set_exception(HandshakeError(event.reason))

    def _on_session_up(self, event: SessionUp) -> None:
        previous, self.ready = self.ready, event.ready
        self._epoch = event.epoch
        self.dead_reason = None
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_result(event.ready)
            return
        logger.warning(
            "session %d with the engine core open again (engine %s)",
            event.epoch,
            event.ready.engine_id or "?",
        )
        if previous is not None and (previous.model, previous.max_model_len) != (
            event.ready.model,
            event.ready.max_model_len,
        ):
            logger.error(
                "the engine core now serves %s (max_model_len %d), not %s (%d): restart "
                "this frontend to pick up the new model",
                event.ready.model,
                event.ready.max_model_len,
                previous.model,
                previous.max_model_len,
            )

    def _on_session_lost(self, event: SessionLost) -> None:
        if self._final:
            return
        reason = event.reason if event.final else f"{event.reason}; reconnecting"
        self.dead_reason = reason
        if self._queues or self._utility_calls:
            logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        else:
            logger.error("%s", reason)
        self._fail_all(reason)
        if event.final:
            self._final = True
            if self._on_dead is not None:
                try:
                    self._on_dead(reason)
                except Exception:
                    logger.exception("on_dead callback failed")

    def _on_outputs(self, message: m.EngineOutputs) -> None:
        if message.scheduler_stats is not None:
            self.latest_stats = message.scheduler_stats
        self._notify("on_outputs", message, time.monotonic())
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None and not output.duplicate_id:  # not the live request's
                queue.put_nowait(output)

    def _notify(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            try:
                getattr(observer, event)(*args)
            except Exception:
                logger.exception("request observer %s.%s failed", type(observer).__name__, event)

    def _fail_all(self, reason: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(_Dead(reason))
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def _stop_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await asyncio.to_thread(session.stop)
