"""A synchronous client of the engine core, for frontends that are not HTTP (benchmarks,
batch jobs, other servers). Token ids in, token ids out; no torch, no tokenizer.

    client = EngineCoreClient("ipc:///run/vtllm/engine.sock", "my-frontend")
    client.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=16))
    for output in client.stream("r1"):
        print(output.new_token_ids, output.finish_reason)
    client.close()

Heartbeats: the client answers the engine's heartbeats whenever it polls. A client that
does not poll for ``VT_HEARTBEAT_TIMEOUT_S`` is taken for dead and its requests aborted.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from vtllm import envs
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m


class EngineDeadError(RuntimeError):
    """The engine core said it is dead, or fell silent past the heartbeat timeout."""


class HandshakeError(RuntimeError):
    """The engine core refused the handshake or did not answer in time."""


class EngineCoreClient:
    def __init__(
        self,
        address: str,
        client_name: str = "vtllm-client",
        timeout_s: float = 60.0,
        context: zmq.Context | None = None,
        curve_keys: transport.CurveKeys | None = None,
    ) -> None:
        """Connect and handshake (raises ``HandshakeError``). ``curve_keys``: the engine's
        key file (``transport.CurveKeys.load``) when it listens on a secured tcp:// address."""
        self._ctx = context or zmq.Context.instance()
        self._socket = transport.configure(self._ctx.socket(zmq.DEALER))
        transport.secure_client(self._socket, curve_keys)
        self._socket.connect(address)
        self._decoder = codec.engine_to_client_decoder()
        self._pending: dict[str, deque[m.RequestOutput]] = defaultdict(deque)
        self._utility_results: dict[int, m.UtilityResponse] = {}
        self._next_call_id = 0
        self._last_heard = time.monotonic()
        self._last_sent = 0.0
        self.latest_stats: m.SchedulerStats | None = None
        self.ready = self._handshake(client_name or f"client-{os.getpid()}", timeout_s)

    def _handshake(self, client_name: str, timeout_s: float) -> m.Ready:
        self._send(m.Hello(m.PROTOCOL_VERSION, client_name))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._socket.poll(100):
                continue
            message = self._decoder.decode(self._socket.recv())
            if isinstance(message, m.Ready):
                return message
            if isinstance(message, m.HandshakeRefused):
                raise HandshakeError(f"engine core refused the handshake: {message.reason}")
        raise HandshakeError(f"no answer from the engine core within {timeout_s:.0f}s")

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: m.SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self._send(
            m.AddRequest(
                request_id, prompt_token_ids, sampling_params, time.time(), priority, cache_salt
            )
        )

    def abort(self, request_ids: list[str]) -> None:
        self._send(m.AbortRequests(list(request_ids)))

    def get_outputs(self, timeout_s: float = 1.0) -> list[m.RequestOutput]:
        """Outputs that arrived within ``timeout_s`` (possibly none), for any request."""
        got = [out for queue in self._pending.values() for out in queue]
        self._pending.clear()
        if got:
            return got
        self._pump(timeout_s)
        got = [out for queue in self._pending.values() for out in queue]
        self._pending.clear()
        return got

    def stream(self, request_id: str, timeout_s: float = 600.0) -> Iterator[m.RequestOutput]:
        """This request's outputs until it finishes. Outputs of other requests that arrive
        meanwhile are kept for their own ``stream``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            queue = self._pending.get(request_id)
            while queue:
                output = queue.popleft()
                yield output
                if output.finish_reason is not None:
                    self._pending.pop(request_id, None)
                    return
            self._pump(0.5)
        raise TimeoutError(f"request {request_id} did not finish within {timeout_s:.0f}s")

    def utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._next_call_id += 1
        call_id = self._next_call_id
        raw_args = [msgspec.Raw(codec.encode_value(a)) for a in args]
        self._send(m.UtilityRequest(call_id, method, raw_args))
        deadline = time.monotonic() + timeout_s
        while call_id not in self._utility_results:
            if time.monotonic() > deadline:
                raise TimeoutError(f"utility {method!r} got no answer within {timeout_s:.0f}s")
            self._pump(0.2)
        response = self._utility_results.pop(call_id)
        if not response.ok:
            raise RuntimeError(f"utility {method!r} failed: {response.error}")
        return codec.decode_value(response.result)

    def close(self) -> None:
        try:
            self._send(m.Goodbye())
        finally:
            self._socket.close(linger=100)

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------

    def _send(self, message: msgspec.Struct) -> None:
        self._socket.send(codec.encode(message))
        self._last_sent = time.monotonic()

    def _pump(self, timeout_s: float) -> None:
        """Receive whatever arrives within ``timeout_s``; keep the heartbeat going."""
        now = time.monotonic()
        if now - self._last_sent >= envs.VT_HEARTBEAT_INTERVAL_S:
            self._send(m.Heartbeat(time.time()))
        if now - self._last_heard > envs.VT_HEARTBEAT_TIMEOUT_S:
            raise EngineDeadError(
                f"no message from the engine core for {now - self._last_heard:.0f}s"
            )
        if not self._socket.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                message = self._decoder.decode(frame)
            except codec.ProtocolError:
                continue
            if isinstance(message, m.EngineOutputs):
                if message.scheduler_stats is not None:
                    self.latest_stats = message.scheduler_stats
                for output in message.outputs:
                    self._pending[output.request_id].append(output)
            elif isinstance(message, m.UtilityResponse):
                self._utility_results[message.call_id] = message
            elif isinstance(message, m.EngineDead):
                raise EngineDeadError(message.reason)
