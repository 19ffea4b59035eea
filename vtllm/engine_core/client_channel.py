"""The engine core's client socket: one ROUTER owned by one I/O thread.

The thread answers handshakes and heartbeats, decodes client messages into the engine
loop's inbox, and sends what the loop pushes to it over an inproc PULL socket. It keeps
answering while the loop sits inside a long model execution, so clients never mistake a
long prefill for a dead engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from vtllm import envs
from vtllm.engine_core.core import ClientId
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)


@dataclass
class ClientGone:
    """Inbox item: a client said Goodbye or fell silent past the heartbeat timeout."""


class ClientChannel(threading.Thread):
    """Owns the client ROUTER socket: handshake, heartbeats, decode, send."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        ready: m.Ready,
        inbox: queue.Queue,
        curve_keys: transport.CurveKeys | None = None,
    ):
        super().__init__(name="vtllm-client-io", daemon=True)
        self.curve_keys = curve_keys
        self.ctx = ctx
        self.address = address
        self.ready = ready
        self.inbox = inbox
        self.outbox_address = f"inproc://vtllm-outbox-{uuid.uuid4().hex}"
        self._outbox = ctx.socket(zmq.PULL)
        self._outbox.bind(self.outbox_address)  # bound before the loop's PUSH connects
        self._stop_event = threading.Event()
        self.clients: dict[ClientId, float] = {}  # identity → last heard (monotonic)
        self.bound = threading.Event()

    def run(self) -> None:
        router = transport.configure(self.ctx.socket(zmq.ROUTER))
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its name
        authenticator = transport.secure_server(router, self.curve_keys)
        router.bind(self.address)
        self.bound.set()
        decoder = codec.client_to_engine_decoder()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        interval = envs.VT_HEARTBEAT_INTERVAL_S
        timeout = envs.VT_HEARTBEAT_TIMEOUT_S
        next_beat = time.monotonic() + interval
        try:
            while not self._stop_event.is_set():
                events = dict(poller.poll(timeout=100))
                if self._outbox in events:
                    while True:
                        try:
                            frames = self._outbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._send(router, frames[0], frames[1])
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(router, decoder, frames)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + interval
                    beat = codec.encode(m.Heartbeat(timestamp=time.time()))
                    for identity, last in list(self.clients.items()):
                        if now - last > timeout:
                            logger.warning(
                                "client %s silent for %.0fs; treating it as gone",
                                identity.hex(),
                                now - last,
                            )
                            del self.clients[identity]
                            self.inbox.put((identity, ClientGone()))
                        else:
                            self._send(router, identity, beat)
        finally:
            router.close(linger=0)
            self._outbox.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            transport.unlink_ipc(self.address)

    def _send(self, router: zmq.Socket, identity: bytes, payload: bytes) -> None:
        try:
            router.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone; its requests are aborted on timeout
            logger.debug("cannot send to client %s: %s", identity.hex(), e)

    def _on_frames(self, router: zmq.Socket, decoder: codec.Decoder, frames: list[bytes]) -> None:
        if len(frames) != 2:
            logger.warning("dropping a client message of %d frames (expected 1)", len(frames) - 1)
            return
        identity, payload = frames
        try:
            message = decoder.decode(payload)
        except codec.ProtocolError as e:
            logger.warning("dropping an undecodable message from client %s: %s", identity.hex(), e)
            return
        if isinstance(message, m.Hello):
            if message.protocol_version != m.PROTOCOL_VERSION:
                reason = (
                    f"protocol version {message.protocol_version} is not supported; this "
                    f"engine speaks version {m.PROTOCOL_VERSION}: upgrade the client"
                )
                logger.warning("refused client %r: %s", message.client_name, reason)
                self._send(router, identity, codec.encode(m.HandshakeRefused(reason)))
                return
            logger.info("client %r connected", message.client_name)
            self.clients[identity] = time.monotonic()
            self._send(router, identity, codec.encode(self.ready))
            return
        if identity not in self.clients:
            logger.warning(
                "dropping %s from a client that has not said Hello", type(message).__name__
            )
            return
        self.clients[identity] = time.monotonic()
        if isinstance(message, m.Heartbeat):
            return
        if isinstance(message, m.Goodbye):
            del self.clients[identity]
            self.inbox.put((identity, ClientGone()))
            return
        self.inbox.put((identity, message))

    def stop(self) -> None:
        self._stop_event.set()
