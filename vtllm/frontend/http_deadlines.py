"""Deadlines on reading a request, against clients that send slowly on purpose.

uvicorn's own ``timeout_keep_alive`` only runs between requests: a connection that opens
and never finishes its headers, or dribbles its body a byte at a time, is never timed out
and holds a socket and its buffers for ever. ``DeadlineH11Protocol`` is uvicorn's h11
protocol with two more timers:

- **header deadline**: from a connection's start (or the first byte after a keep-alive
  pause) to the end of the request headers: ``header_timeout_s``;
- **body deadline**: from the end of the headers to the end of the body: ``body_timeout_s``
  (whether or not the route reads the body).

When one fires before the response has started, the client gets ``408`` (OpenAI error
shape, ``Connection: close``) and the connection is closed; the app, if it was reading
the body, sees a disconnect. Header size stays bounded by h11's
``h11_max_incomplete_event_size`` (431/400 beyond it).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _timeout_body(message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None}
    return json.dumps({"error": {**error, "code": "request_timeout"}}).encode()


# what is being read → (the attribute with its deadline, the flag that sets it)
_LIMITS = {
    "headers": ("header_timeout_s", "--http-header-timeout"),
    "body": ("body_timeout_s", "--http-body-timeout"),
}


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol with header and body read deadlines (class attributes; make a
    configured subclass with ``with_deadlines``)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers" or "body" while a deadline runs

    @classmethod
    def with_deadlines(cls, header_timeout_s: float, body_timeout_s: float) -> type:
        return type(
            "DeadlineH11Protocol",
            (cls,),
            {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request_state()

    def _follow_request_state(self) -> None:
        """Run the deadline that matches what the client owes us now."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            # between requests with nothing received, uvicorn's keep-alive timer runs
            if self.timeout_keep_alive_task is None and self._reading != "headers":
                self._arm("headers", self.header_timeout_s)
        elif state is h11.SEND_BODY:
            if self._reading != "body":
                self._arm("body", self.body_timeout_s)
        else:
            self._disarm()

    def _arm(self, reading: str, timeout_s: float) -> None:
        self._disarm()
        self._reading = reading
        self._read_timer = self.loop.call_later(timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = None
        self._reading = None

    def _on_deadline(self) -> None:
        reading = self._reading
        self._read_timer = None
        self._reading = None
        if self.transport.is_closing():
            return
        timeout_s, flag = _LIMITS[reading or "headers"]
        cycle = self.cycle if reading == "body" else None
        if cycle is None or not cycle.response_started:
            self.logger.info("closing a connection: request %s not received in time", reading)
            self._send_408(
                f"the request {reading} did not arrive within "
                f"{getattr(self, timeout_s):g} s; send faster or raise {flag}"
            )
        if cycle is not None:  # the app, if it is reading the body, sees a disconnect
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _send_408(self, message: str) -> None:
        body = _timeout_body(message)
        head = (
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        self.transport.write(head + body)
