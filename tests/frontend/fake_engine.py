"""A stand-in engine core for frontend unit tests: the real protocol over a real ZMQ
ROUTER socket, in a thread. It answers ``Hello`` with ``Ready`` and answers each
``AddRequest`` with fixed token ids, one per output message.

Knobs (set before or during a test): ``token_ids``, ``first_token_delay_s``,
``token_interval_s``, ``silent`` (stop answering anything, heartbeats included),
``send_dead(reason)``, ``send_raw(frame)``, ``send_stats(stats)`` (an ``EngineOutputs``
with only ``SchedulerStats``), ``report_before_first_token`` (an empty output as soon as a
request arrives, as an engine reporting its scheduling would), ``guard_max_model_len`` (refuse
requests with the real engine guard, ``validate_request``, at this max_model_len instead of
the advertised one, as an engine restarted with another limit would), ``unavailable`` (refuse
every request with ``ErrorCode.UNAVAILABLE`` and this reason). Utility calls are answered with
``[method, *args]`` (or an error for method "fail"). It records ``added`` and ``aborted`` request ids.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from vtllm.engine_core.guards import validate_request
from vtllm.protocol import codec
from vtllm.protocol import messages as m


@dataclass
class _Live:
    identity: bytes
    request: m.AddRequest
    next_idx: int
    due: float


class FakeEngine:
    def __init__(
        self,
        address: str,
        token_ids: list[int],
        max_model_len: int = 256,
        vocab_size: int = 1000,
        eos_token_ids: tuple[int, ...] = (0, 2),  # the test tokenizer's
        model: str = "fake-model",
    ) -> None:
        self.address = address
        self.token_ids = list(token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.model = model
        self.first_token_delay_s = 0.0
        self.token_interval_s = 0.0
        self.refuse_reason: str | None = None
        self.silent = False
        self.report_before_first_token = False
        self.guard_max_model_len: int | None = None
        self.unavailable: str | None = None
        # engine-side (queue, prefill) seconds sent with each request's first token
        self.first_token_timings: tuple[float, float] | None = None
        self.added: list[m.AddRequest] = []
        self.aborted: list[str] = []
        self.goodbyes = 0
        self._dead_reason: str | None = None
        self._raw_frames: list[bytes] = []
        self._live: dict[str, _Live] = {}
        self._identities: set[bytes] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-engine")
        self._bound = threading.Event()

    def start(self) -> FakeEngine:
        self._thread.start()
        assert self._bound.wait(5), "fake engine did not bind"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def send_dead(self, reason: str) -> None:
        self._dead_reason = reason

    def send_raw(self, frame: bytes) -> None:
        self._raw_frames.append(frame)

    def send_stats(self, stats: m.SchedulerStats) -> None:
        self.send_raw(codec.encode(m.EngineOutputs([], stats)))

    def aborted_snapshot(self) -> list[str]:
        with self._lock:
            return list(self.aborted)

    # -- thread -------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._bound.set()
        decoder = codec.client_to_engine_decoder()
        try:
            while not self._stop.is_set():
                if sock.poll(5):
                    identity, frame = sock.recv_multipart()
                    if not self.silent:
                        self._handle(sock, identity, decoder.decode(frame))
                while self._raw_frames:
                    frame = self._raw_frames.pop(0)
                    for identity in self._identities:
                        sock.send_multipart([identity, frame])
                if self._dead_reason is not None:
                    for identity in self._identities:
                        sock.send_multipart(
                            [identity, codec.encode(m.EngineDead(self._dead_reason))]
                        )
                    self._dead_reason = None
                    self.silent = True
                if not self.silent:
                    self._emit_due(sock)
        finally:
            sock.close()
            ctx.term()

    def _handle(self, sock: zmq.Socket, identity: bytes, msg: m.ClientToEngine) -> None:
        if isinstance(msg, m.Hello):
            if self.refuse_reason:
                reply: m.EngineToClient = m.HandshakeRefused(self.refuse_reason)
            else:
                self._identities.add(identity)
                reply = m.Ready(
                    protocol_version=m.PROTOCOL_VERSION,
                    model=self.model,
                    max_model_len=self.max_model_len,
                    vocab_size=self.vocab_size,
                    num_kv_blocks=64,
                    block_size=16,
                    eos_token_ids=self.eos_token_ids,
                )
            sock.send_multipart([identity, codec.encode(reply)])
        elif isinstance(msg, m.Heartbeat):
            sock.send_multipart([identity, codec.encode(m.Heartbeat(time.time()))])
        elif isinstance(msg, m.AddRequest):
            with self._lock:
                self.added.append(msg)
            refusal = self._refusal(msg)
            if refusal is not None:
                sock.send_multipart([identity, codec.encode(m.EngineOutputs([refusal]))])
                return
            due = time.monotonic() + self.first_token_delay_s
            self._live[msg.request_id] = _Live(identity, msg, 0, due)
            if self.report_before_first_token:
                report = m.RequestOutput(
                    msg.request_id, [], num_prompt_tokens=len(msg.prompt_token_ids)
                )
                sock.send_multipart([identity, codec.encode(m.EngineOutputs([report]))])
        elif isinstance(msg, m.AbortRequests):
            with self._lock:
                self.aborted.extend(msg.request_ids)
            for request_id in msg.request_ids:
                self._live.pop(request_id, None)
        elif isinstance(msg, m.UtilityRequest):
            args = [codec.decode_value(a) for a in msg.args]
            if msg.method == "fail":
                reply = m.UtilityResponse(msg.call_id, ok=False, error="it failed")
            else:
                result = msgspec.Raw(codec.encode_value([msg.method, *args]))
                reply = m.UtilityResponse(msg.call_id, ok=True, result=result)
            sock.send_multipart([identity, codec.encode(reply)])
        elif isinstance(msg, m.Goodbye):
            self.goodbyes += 1

    def _refusal(self, add: m.AddRequest) -> m.RequestOutput | None:
        code, message, param = None, None, None
        if self.unavailable is not None:
            code, message = m.ErrorCode.UNAVAILABLE, self.unavailable
        elif self.guard_max_model_len is not None:
            refusal = validate_request(
                add.prompt_token_ids, add.sampling_params, self.guard_max_model_len, self.vocab_size
            )
            if refusal is not None:
                code, message, param = m.ErrorCode.INVALID_REQUEST, refusal.message, refusal.param
        if code is None:
            return None
        return m.RequestOutput(
            add.request_id,
            [],
            m.FinishReason.ERROR,
            error=message,
            num_prompt_tokens=len(add.prompt_token_ids),
            error_code=code,
            error_param=param,
        )

    def _emit_due(self, sock: zmq.Socket) -> None:
        now = time.monotonic()
        for request_id, live in list(self._live.items()):
            if live.due > now:
                continue
            params = live.request.sampling_params
            limit = len(self.token_ids)
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens)
            token_id = self.token_ids[live.next_idx]
            live.next_idx += 1
            finish = None
            if live.next_idx >= limit:
                finish = (
                    m.FinishReason.LENGTH
                    if live.next_idx < len(self.token_ids)
                    else (m.FinishReason.STOP)
                )
            output = m.RequestOutput(
                request_id=request_id,
                new_token_ids=[token_id],
                finish_reason=finish,
                num_prompt_tokens=len(live.request.prompt_token_ids),
                new_logprobs=[-0.5] if params.logprobs is not None else None,
            )
            if live.next_idx == 1 and self.first_token_timings is not None:
                output.queue_time_s, output.prefill_time_s = self.first_token_timings
            sock.send_multipart([live.identity, codec.encode(m.EngineOutputs([output]))])
            live.due = now + self.token_interval_s
            if finish is not None:
                del self._live[request_id]
