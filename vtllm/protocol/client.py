"""A synchronous client of the engine core, for frontends that are not HTTP (benchmarks,
batch jobs, other servers). Token ids in, token ids out; no torch, no tokenizer.

    client = EngineCoreClient("ipc:///run/vtllm/engine.sock", "my-frontend")
    client.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=16))
    for output in client.stream("r1"):
        print(output.new_token_ids, output.finish_reason)
    client.close()

The socket belongs to a ``session.SessionThread`` (the same session rules as the asyncio
client): heartbeats and the engine's liveness are kept by that thread, so a caller that
does not poll for minutes keeps its session. When the session is lost, the calls that wait
for its requests raise ``EngineDeadError`` once (those requests are gone); with
``reconnect=True`` (or after the engine said ``SessionUnknown``) the thread handshakes again
and new requests are served once the engine answers. Use from one thread.
"""

from __future__ import annotations

import queue
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

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

__all__ = ["EngineCoreClient", "EngineDeadError", "FrameTooLargeError", "HandshakeError"]


class EngineCoreClient:
    def __init__(
        self,
        address: str,
        client_name: str = "vtllm-client",
        timeout_s: float = 60.0,
        curve_keys: transport.ClientKeys | None = None,
        reconnect: bool = False,
        engine_alive: Callable[[], bool] | None = None,
    ) -> None:
        """Connect and handshake (raises ``HandshakeError``). ``curve_keys``: this
        client's key file (``transport.ClientKeys.load``, made by ``vtllm keygen client``)
        when the engine listens on a CurveZMQ-secured tcp:// address.
        ``reconnect``: losing the engine is not final (see ``EngineClient.connect``).
        ``engine_alive``: for a caller that started the engine core itself, e.g. its
        process's ``is_alive``; the handshake stops waiting (``HandshakeError``) as soon
        as it says False, instead of at ``timeout_s``."""
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._pending: dict[str, deque[m.RequestOutput]] = defaultdict(deque)
        self._in_flight: set[str] = set()
        self._lost: dict[str, str] = {}  # request id → why its session was lost
        self._utility_results: dict[int, m.UtilityResponse] = {}
        self._utility_lost: str | None = None
        self._next_call_id = 0
        self._epoch = 0
        self.dead_reason: str | None = None  # why the engine is not available now
        self.latest_stats: m.SchedulerStats | None = None
        self._session = SessionThread(
            address, client_name, self._events.put, curve_keys=curve_keys, reconnect=reconnect
        )
        self._session.start()
        self.ready = self._handshake(address, timeout_s, engine_alive)

    def _handshake(
        self, address: str, timeout_s: float, engine_alive: Callable[[], bool] | None
    ) -> m.Ready:
        deadline = time.monotonic() + timeout_s
        while self._epoch == 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._session.stop()
                raise HandshakeError(
                    f"engine core at {address} did not answer the handshake within {timeout_s:.0f}s"
                )
            if engine_alive is not None and not engine_alive():
                self._session.stop()
                raise HandshakeError(
                    f"the engine core for {address} exited before it answered the handshake "
                    "(its log says why)"
                )
            try:
                event = self._events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if isinstance(event, HandshakeFailed):
                self._session.stop()
                raise HandshakeError(event.reason)
            self._on_event(event)
        return self.ready

    @property
    def is_alive(self) -> bool:
        return self._epoch > 0 and self.dead_reason is None

    def wait_connected(self, timeout_s: float) -> bool:
        """After a lost session: wait until a new one is open (True) or ``timeout_s``
        passes (False). Events that arrive meanwhile are kept as usual."""
        deadline = time.monotonic() + timeout_s
        self._drain(0.0)
        while not self.is_alive and time.monotonic() < deadline:
            self._drain(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.is_alive

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: m.SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Send a request. Raises ``EngineDeadError`` while no session is open and
        ``FrameTooLargeError`` (nothing sent) when it is longer than the engine reads."""
        self._drain(0.0)
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._in_flight:  # the engine would refuse it (duplicate_id)
            raise ValueError(f"request id {request_id!r} is already in flight; use a new id")
        self._send(
            m.AddRequest(
                request_id, prompt_token_ids, sampling_params, time.time(), priority, cache_salt
            )
        )
        self._in_flight.add(request_id)

    def abort(self, request_ids: list[str]) -> None:
        self._in_flight.difference_update(request_ids)
        self._send(m.AbortRequests(list(request_ids)))

    def get_outputs(self, timeout_s: float = 1.0) -> list[m.RequestOutput]:
        """Outputs that arrived within ``timeout_s`` (possibly none), for any request.
        Raises ``EngineDeadError`` (once) when the session of requests in flight was lost."""
        if not self._pending:
            self._drain(timeout_s)
        got = [out for q in self._pending.values() for out in q]
        self._pending.clear()
        if not got and self._lost:
            reasons = set(self._lost.values())
            self._lost.clear()
            raise EngineDeadError("; ".join(sorted(reasons)))
        return got

    def stream(self, request_id: str, timeout_s: float = 600.0) -> Iterator[m.RequestOutput]:
        """This request's outputs until it finishes. Outputs of other requests that arrive
        meanwhile are kept for their own ``stream``. Raises ``EngineDeadError`` when its
        session was lost."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pending = self._pending.get(request_id)
            while pending:
                output = pending.popleft()
                yield output
                if output.finish_reason is not None:
                    self._pending.pop(request_id, None)
                    return
            if request_id in self._lost:
                raise EngineDeadError(self._lost.pop(request_id))
            self._drain(0.5)
        raise TimeoutError(f"request {request_id} did not finish within {timeout_s:.0f}s")

    def utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._drain(0.0)
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._next_call_id += 1
        call_id = self._next_call_id
        raw_args = [msgspec.Raw(codec.encode_value(a)) for a in args]
        self._utility_lost = None
        self._send(m.UtilityRequest(call_id, method, raw_args))
        deadline = time.monotonic() + timeout_s
        while call_id not in self._utility_results:
            if self._utility_lost is not None:
                raise EngineDeadError(self._utility_lost)
            if time.monotonic() > deadline:
                raise TimeoutError(f"utility {method!r} got no answer within {timeout_s:.0f}s")
            self._drain(0.2)
        response = self._utility_results.pop(call_id)
        if not response.ok:
            raise RuntimeError(f"utility {method!r} failed: {response.error}")
        return codec.decode_value(response.result)

    def close(self) -> None:
        if self.is_alive:
            self._send(m.Goodbye())
        self._session.stop()

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------

    def _send(self, message: msgspec.Struct) -> None:
        self._session.send(message, self._epoch)

    def _drain(self, timeout_s: float) -> None:
        """Handle every event that arrives within ``timeout_s`` (or is already there)."""
        try:
            event = self._events.get(timeout=timeout_s) if timeout_s > 0 else None
        except queue.Empty:
            return
        while True:
            if event is not None:
                self._on_event(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _on_event(self, event: Event) -> None:
        if isinstance(event, m.EngineOutputs):
            if event.scheduler_stats is not None:
                self.latest_stats = event.scheduler_stats
            for output in event.outputs:
                if output.duplicate_id:  # a refused re-add: the live request goes on
                    continue
                self._pending[output.request_id].append(output)
                if output.finish_reason is not None:
                    self._in_flight.discard(output.request_id)
        elif isinstance(event, m.UtilityResponse):
            self._utility_results[event.call_id] = event
        elif isinstance(event, SessionUp):
            self.ready, self._epoch, self.dead_reason = event.ready, event.epoch, None
        elif isinstance(event, SessionLost):
            reason = event.reason if event.final else f"{event.reason}; reconnecting"
            self.dead_reason = reason
            for request_id in self._in_flight:
                self._lost[request_id] = reason
            self._in_flight.clear()
            self._utility_lost = reason
