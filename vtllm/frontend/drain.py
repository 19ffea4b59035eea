"""Graceful stop of the HTTP frontend (SIGTERM / SIGINT).

::

    signal ──▶ stopping: new requests → 503 "shutting down", /health → 503
               running requests go on ......................┐
               all done ──────────────────────────────────▶ exit (uvicorn closes idle connections)
               --shutdown-timeout passed ──▶ expired: every unfinished request ends now
                   stream:       an error event (code "shutting_down"), then data: [DONE]
                   non-streamed: a 503 JSON error
               ──▶ exit

A second signal expires the drain at once. ``DrainMiddleware`` counts every HTTP request
from its first byte to its last (a stream until its ``[DONE]``), so "all done" means that
no response is still being written. The ``ChoiceMerger`` of every running request is
registered with the ``Drain``, which interrupts them when the timeout passes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any, Protocol

import msgspec
import uvicorn

from vtllm.frontend.openai_types import OpenAIError

logger = logging.getLogger(__name__)

# Routes that answer while stopping (monitoring must see the server until it is gone).
_OPEN_WHILE_STOPPING = frozenset({"/metrics", "/version", "/openapi.json"})


class ServerStopping(OpenAIError):
    """The server is stopping and this request was not allowed to start or to finish."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "service_unavailable", None, "shutting_down")


class Interruptible(Protocol):
    def interrupt(self, exc: BaseException) -> None: ...


class Drain:
    """Shared state of a stopping server: whether it stops, the requests still running,
    and the running generations to interrupt when the drain timeout passes."""

    def __init__(self) -> None:
        self.stopping = False
        self.expired = False
        self.num_in_flight = 0
        self._running: set[Interruptible] = set()
        self._changed = asyncio.Event()

    def begin(self) -> None:
        self.stopping = True

    def refusal(self) -> ServerStopping:
        return ServerStopping("the server is shutting down and accepts no new requests")

    def expiry(self) -> ServerStopping:
        return ServerStopping(
            "the server is shutting down and its --shutdown-timeout passed before this "
            "request finished"
        )

    def expire(self) -> None:
        """End every running generation now (each gets ``expiry()``)."""
        self.stopping = self.expired = True
        for running in list(self._running):
            running.interrupt(self.expiry())

    def add(self, running: Interruptible) -> None:
        """Register a generation; refused with ``expiry()`` once the drain has expired."""
        if self.expired:
            raise self.expiry()
        self._running.add(running)

    def discard(self, running: Interruptible) -> None:
        self._running.discard(running)

    def request_started(self) -> None:
        self.num_in_flight += 1

    def request_ended(self) -> None:
        self.num_in_flight -= 1
        self._changed.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_in_flight > 0:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return self.num_in_flight == 0
        return True

    async def run(self, timeout_s: float, expired_grace_s: float = 5.0) -> None:
        """Let running requests finish for up to ``timeout_s`` seconds, then expire the
        rest and give them ``expired_grace_s`` to write their last bytes."""
        if self.num_in_flight:
            logger.info(
                "stopping: refusing new requests; %d running may finish within %.0fs "
                "(--shutdown-timeout)",
                self.num_in_flight,
                timeout_s,
            )
        if await self.wait_idle(timeout_s):
            return
        logger.warning(
            "stopping: --shutdown-timeout (%.0fs) passed; ending %d unfinished requests "
            "with a shutting_down error",
            timeout_s,
            self.num_in_flight,
        )
        self.expire()
        if not await self.wait_idle(expired_grace_s):
            logger.warning(
                "stopping: %d requests still open %.0fs after the shutdown timeout",
                self.num_in_flight,
                expired_grace_s,
            )


class DrainMiddleware:
    """ASGI middleware: counts HTTP requests in flight and, while stopping, answers new
    ones with 503 (``/health`` included) except the monitoring routes."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.stopping and scope["path"] not in _OPEN_WHILE_STOPPING:
            is_health = scope["path"] == "/health"
            error = ServerStopping("shutting down") if is_health else self.drain.refusal()
            await _send_json(send, error.status_code, error.to_dict())
            return
        self.drain.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.request_ended()


async def _send_json(send: Any, status_code: int, content: Any) -> None:
    body = msgspec.json.encode(content)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# What the first frontend process sends the others (--api-server-count) when it stops:
# a drain unless one runs already (systemd and Ctrl-C signal every process at once, and
# a second SIGTERM would cut the drain short).
PEER_STOP_SIGNAL = signal.SIGUSR1


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM / SIGINT start a drain (``Drain.run``) instead of
    stopping at once, and uvicorn exits only after it. A second signal expires the drain
    (``PEER_STOP_SIGNAL`` starts one, and never expires it). ``stop_signal`` is the first
    signal received (None if none)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self.stop_signal: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(PEER_STOP_SIGNAL, self.handle_exit)
        try:
            await super().serve(sockets)
        finally:
            if previous is not None:
                signal.signal(PEER_STOP_SIGNAL, previous)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler: it may interrupt the loop anywhere, so only hand over.
        if self.stop_signal is None:
            self.stop_signal = sig
        if self._loop is None or not self.started:
            self.should_exit = True  # still starting: nothing to drain
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is None:
            logger.info("%s: stopping (--shutdown-timeout %.0fs)", name, self.timeout_s)
            self.drain.begin()
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        elif not self.drain.expired and sig != PEER_STOP_SIGNAL:
            logger.warning("%s again: ending the running requests now", name)
            self.drain.expire()

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self.timeout_s)
        finally:
            self.should_exit = True
