"""A plain HTTP/1.1 client on one socket (h11 parses the replies), for tests that must know
the connection: a bad request and then a good one on the same kept-alive connection, a
client that sends its headers or body a byte at a time, a reply's raw headers.

Blocking: async tests call it through ``asyncio.to_thread`` (the server under test runs
on their event loop)."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any

import h11


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RawConnection:
    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.conn = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """Send one request on this connection and read its whole reply."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        all_headers = {"host": "127.0.0.1", **(headers or {})}
        if body is not None:
            all_headers.setdefault("content-type", "application/json")
            all_headers["content-length"] = str(len(body))
        self.sock.sendall(
            self.conn.send(
                h11.Request(method=method, target=path, headers=list(all_headers.items()))
            )
        )
        if body:
            self.sock.sendall(self.conn.send(h11.Data(data=body)))
        self.sock.sendall(self.conn.send(h11.EndOfMessage()))
        return self._read_reply()

    def _read_reply(self) -> Reply:
        status, headers, chunks = 0, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(65536)
                self.conn.receive_data(data)  # b"" = the server closed
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection before replying")
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return Reply(status, headers, b"".join(chunks))

    @property
    def reusable(self) -> bool:
        """Whether the server left this connection open for another request."""
        return self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE


def dribble(
    port: int, pieces: list[bytes], interval_s: float, give_up_s: float
) -> tuple[bytes, float]:
    """Connect and send ``pieces`` one per ``interval_s`` until the server answers or
    closes, then read until it closes. Returns (everything the server sent, seconds from
    connecting to the close). Fails if the server keeps the connection past ``give_up_s``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=give_up_s)
    started = time.monotonic()
    received = b""
    try:
        sock.settimeout(interval_s)
        for piece in pieces:
            try:
                sock.sendall(piece)
                received = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                return received, time.monotonic() - started
            if not received:  # closed
                return received, time.monotonic() - started
            break  # the server answered: stop sending, read until it closes
        sock.settimeout(max(0.1, give_up_s - (time.monotonic() - started)))
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(
                    f"the server kept a slow connection open for {give_up_s}s"
                ) from None
            if not data:
                break
            received += data
        return received, time.monotonic() - started
    finally:
        sock.close()


def parse_raw_reply(raw: bytes) -> Reply:
    """A reply read off a raw socket (status line, headers, then a body up to close)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return Reply(status, {k.lower(): v for k, v in headers.items()}, body)
