"""asyncio client of the engine core: one ZMQ DEALER, one background loop.

The loop reads every message from the engine core (``EngineOutputs`` routed by request
id into per-request queues, ``UtilityResponse`` into futures, ``Heartbeat``/``EngineDead``),
sends a ``Heartbeat`` every ``VT_HEARTBEAT_INTERVAL_S`` and declares the engine dead after
``VT_HEARTBEAT_TIMEOUT_S`` of silence, on ``EngineDead``, or when the optional
``engine_alive`` probe says so. On death every in-flight request ends with
``EngineDeadError`` and ``on_dead(reason)`` fires once.

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
import zmq
import zmq.asyncio

from vtllm import envs
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m
from vtllm.protocol.client import EngineDeadError, HandshakeError

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the loop checks the probe and the silence timeout


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


class _Dead:
    """Queue item telling a request's consumer that the engine died."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class EngineClient:
    """Use: ``await connect(...)``, then ``generate``/``abort``/``utility``, then
    ``close``. All methods run on one event loop."""

    def __init__(self) -> None:
        self.ready: m.Ready | None = None
        self.latest_stats: m.SchedulerStats | None = None
        self.dead_reason: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._decoder = codec.engine_to_client_decoder()
        self._queues: dict[str, asyncio.Queue[m.RequestOutput | _Dead]] = {}
        self._utility_calls: dict[int, asyncio.Future[m.UtilityResponse]] = {}
        self._call_ids = itertools.count(1)
        self._loop_task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._engine_alive: Callable[[], bool] | None = None
        self._on_dead: Callable[[str], Any] | None = None
        self._last_heard = 0.0
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
        curve_keys: transport.CurveKeys | None = None,
    ) -> m.Ready:
        """Connect and handshake. Returns the engine's ``Ready``; raises HandshakeError on
        refusal, on a timeout (default: worker start timeout + heartbeat timeout), or when
        ``engine_alive`` turns false while waiting. ``curve_keys``: the engine's key file
        when it listens on a CurveZMQ-secured tcp:// address."""
        if timeout_s is None:
            timeout_s = envs.VT_WORKER_START_TIMEOUT_S + envs.VT_HEARTBEAT_TIMEOUT_S
        self._engine_alive, self._on_dead = engine_alive, on_dead
        self._ctx = zmq.asyncio.Context()
        self._socket = transport.configure(self._ctx.socket(zmq.DEALER))
        self._socket.setsockopt(zmq.LINGER, 200)  # long enough for Goodbye to leave
        transport.secure_client(self._socket, curve_keys)
        self._socket.connect(address)
        await self._send(m.Hello(protocol_version=m.PROTOCOL_VERSION, client_name=client_name))
        deadline = time.monotonic() + timeout_s
        while self.ready is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await self._close_socket()
                raise HandshakeError(
                    f"engine core at {address} did not answer the handshake within {timeout_s:.0f}s"
                )
            if engine_alive is not None and not engine_alive():
                await self._close_socket()
                raise HandshakeError("engine core process exited before it became ready")
            message = await self._recv(min(_POLL_S, remaining))
            if isinstance(message, m.Ready):
                if message.protocol_version != m.PROTOCOL_VERSION:
                    await self._close_socket()
                    raise HandshakeError(
                        f"engine core speaks protocol {message.protocol_version}, this "
                        f"frontend speaks {m.PROTOCOL_VERSION}; run matching vtllm versions"
                    )
                self.ready = message
            elif isinstance(message, (m.HandshakeRefused, m.EngineDead)):
                await self._close_socket()
                raise HandshakeError(f"engine core refused the connection: {message.reason}")
            elif message is not None:
                logger.debug("ignoring %s before Ready", type(message).__name__)
        self._last_heard = time.monotonic()
        self._loop_task = asyncio.create_task(self._run_loop(), name="vtllm-engine-client")
        return self.ready

    async def close(self) -> None:
        """Say ``Goodbye`` (the engine aborts what this client still owns) and stop."""
        if self._closed:
            return
        if self.is_alive:
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                await self._send(m.Goodbye())
        self._closed = True
        for task in [self._loop_task, *self._side_tasks]:
            if task is not None:
                task.cancel()
        for task in [self._loop_task, *self._side_tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._fail_all("frontend is shutting down")
        await self._close_socket()

    # -- requests ----------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: m.SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[m.RequestOutput]:
        """Add a request and yield its outputs until one carries a finish reason.

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
            await self._send(
                m.AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=sampling_params,
                    arrival_time=time.time(),
                    priority=priority,
                    cache_salt=cache_salt,
                )
            )
            while not finished:
                item = await queue.get()
                if isinstance(item, _Dead):
                    finished = True
                    finish_reason = "error"
                    raise EngineDeadError(item.reason)
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
            await self._send(m.AbortRequests(request_ids=list(request_ids)))

    async def utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method`` in the engine core; returns its decoded result. Raises
        UtilityError, EngineDeadError or TimeoutError."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future[m.UtilityResponse] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            raw_args = [msgspec.Raw(codec.encode_value(a)) for a in args]
            await self._send(m.UtilityRequest(call_id=call_id, method=method, args=raw_args))
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

    async def _send(self, message: msgspec.Struct) -> None:
        """Send without blocking: a DEALER whose queue to the engine is full (the engine
        stopped reading) must not stall the caller, least of all the heartbeat loop."""
        assert self._socket is not None
        try:
            await self._socket.send(codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(
                "engine core is not reading its socket (send queue full)"
            ) from None

    async def _recv(self, timeout_s: float) -> m.EngineToClient | None:
        """One decoded message, or None on timeout or an undecodable frame (logged)."""
        assert self._socket is not None
        if not await self._socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = await self._socket.recv_multipart(copy=False)
        self._last_heard = time.monotonic()
        try:
            return self._decoder.decode(frames[-1].buffer)
        except codec.ProtocolError as e:
            logger.warning("dropping an undecodable frame from the engine core: %s", e)
            return None

    async def _run_loop(self) -> None:
        interval = envs.VT_HEARTBEAT_INTERVAL_S
        timeout = envs.VT_HEARTBEAT_TIMEOUT_S
        next_heartbeat = 0.0
        try:
            while self.dead_reason is None:
                now = time.monotonic()
                if now >= next_heartbeat:
                    with contextlib.suppress(EngineDeadError):  # silence decides, below
                        await self._send(m.Heartbeat(timestamp=time.time()))
                    next_heartbeat = now + interval
                if now - self._last_heard > timeout:
                    self._mark_dead(f"engine core silent for more than {timeout:g}s")
                    break
                if self._engine_alive is not None and not self._engine_alive():
                    self._mark_dead("engine core process exited")
                    break
                wait = max(0.0, min(_POLL_S, next_heartbeat - now))
                message = await self._recv(wait)
                if message is not None:
                    self._handle(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a socket failure: nothing more can reach the engine
            logger.exception("engine client loop failed")
            self._mark_dead(f"engine client failed: {e!r}")

    def _handle(self, message: m.EngineToClient) -> None:
        if isinstance(message, m.EngineOutputs):
            if message.scheduler_stats is not None:
                self.latest_stats = message.scheduler_stats
            self._notify("on_outputs", message, time.monotonic())
            for output in message.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
        elif isinstance(message, m.UtilityResponse):
            future = self._utility_calls.get(message.call_id)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, m.EngineDead):
            self._mark_dead(f"engine core died: {message.reason}")
        elif not isinstance(message, m.Heartbeat):
            logger.warning("unexpected %s from the engine core", type(message).__name__)

    def _notify(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            try:
                getattr(observer, event)(*args)
            except Exception:
                logger.exception("request observer %s.%s failed", type(observer).__name__, event)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None or self._closed:
            return
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        self._fail_all(reason)
        if self._on_dead is not None:
            try:
                self._on_dead(reason)
            except Exception:
                logger.exception("on_dead callback failed")

    def _fail_all(self, reason: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(_Dead(reason))
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
