"""The engine core's client socket: one ROUTER owned by one I/O thread.

The thread answers handshakes and heartbeats, decodes client messages into the engine
loop's inbox, and sends what the loop pushes to it over an inproc PULL socket. It keeps
answering while the loop sits inside a long model execution, so clients never mistake a
long prefill for a dead engine.

Sessions: a client's ``Hello`` opens one (``Ready``); ``Goodbye`` or silence past
``VT_HEARTBEAT_TIMEOUT_S`` ends it (the loop aborts its requests). A message from a client
without a session is never dropped in silence: the client gets ``SessionUnknown`` with the
reason (it fell silent and was dropped, or this engine core restarted) and says Hello again.
A ``Hello`` with a new ``session_id`` from a client that still has a session ends the old
one first; the same ``session_id`` again just gets ``Ready`` again. Once the engine loop has
sent ``EngineDead`` (it is exiting), a ``Hello`` is refused with that reason, so that no
client opens a session with an engine core that is about to vanish.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from vtllm import envs
from vtllm.engine_core.core import ClientId
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)

_MAX_DROPPED_REMEMBERED = 1024  # clients whose drop reason is kept for SessionUnknown
# How an outgoing EngineDead starts: [tag "dead", reason] (a 2-array, then the tag)
_DEAD_PREFIX = codec.encode(m.EngineDead(""))[:-1]


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
        self._session_ids: dict[ClientId, str] = {}
        # why recent clients lost their session (answered with SessionUnknown), bounded
        self._dropped: OrderedDict[ClientId, str] = OrderedDict()
        self._told: OrderedDict[ClientId, None] = OrderedDict()  # warned about, bounded
        self.bound = threading.Event()
        self._going_down: str | None = None  # the EngineDead reason, once the loop sent it

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
        last_loop = time.monotonic()
        next_beat = last_loop + interval
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
                        if self._going_down is None and frames[1].startswith(_DEAD_PREFIX):
                            self._going_down = (
                                codec.engine_to_client_decoder().decode(frames[1]).reason
                            )
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(router, decoder, frames)
                now = time.monotonic()
                if now - last_loop > timeout / 2:
                    # this process was not running (SIGSTOP, a suspended VM): the clients'
                    # silence meanwhile is ours; give each a full timeout from now
                    for identity in self.clients:
                        self.clients[identity] = now
                last_loop = now
                if now >= next_beat:
                    next_beat = now + interval
                    beat = codec.encode(m.Heartbeat(timestamp=time.time()))
                    for identity, last in list(self.clients.items()):
                        if now - last > timeout:
                            logger.warning(
                                "client %s silent for %.1fs; treating it as gone",
                                identity.hex(),
                                now - last,
                            )
                            self._end_session(
                                identity,
                                f"this client was silent for {now - last:.1f}s "
                                f"(VT_HEARTBEAT_TIMEOUT_S={timeout:g}s) and was dropped, and "
                                "the engine aborted its requests",
                            )
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
            if self._going_down is not None:  # no new session with an engine that is exiting
                refusal = f"the engine core is going down: {self._going_down}"
                self._send(router, identity, codec.encode(m.HandshakeRefused(refusal)))
                return
            self._open_session(router, identity, message)
            return
        if identity not in self.clients:
            if not isinstance(message, m.Goodbye):
                self._send(
                    router, identity, codec.encode(m.SessionUnknown(self._unknown(identity)))
                )
            return
        self.clients[identity] = time.monotonic()
        if isinstance(message, m.Heartbeat):
            return
        if isinstance(message, m.Goodbye):
            self._end_session(identity, "this client said goodbye")
            return
        self.inbox.put((identity, message))

    def _open_session(self, router: zmq.Socket, identity: ClientId, hello: m.Hello) -> None:
        same = hello.session_id and self._session_ids.get(identity) == hello.session_id
        if identity in self.clients and not same:
            # the client lost its old session (it failed those requests): end it here too
            self._end_session(identity, "this client opened a new session")
        if not same:
            logger.info("client %r connected", hello.client_name)
        self.clients[identity] = time.monotonic()
        self._session_ids[identity] = hello.session_id
        self._dropped.pop(identity, None)
        self._told.pop(identity, None)
        self._send(router, identity, codec.encode(self.ready))

    def _end_session(self, identity: ClientId, reason: str) -> None:
        """Forget the client; the loop aborts every request it still owns."""
        del self.clients[identity]
        self._session_ids.pop(identity, None)
        self._dropped[identity] = reason
        while len(self._dropped) > _MAX_DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)
        self.inbox.put((identity, ClientGone()))

    def _unknown(self, identity: ClientId) -> str:
        reason = self._dropped.get(identity)
        if reason is None:  # never seen: e.g. this engine core started after the client's Hello
            reason = "it never said hello to this engine core (did the engine core restart?)"
        if identity not in self._told:  # once per client, not once per message
            logger.warning("client %s has no session: %s; telling it", identity.hex(), reason)
            self._told[identity] = None
            while len(self._told) > _MAX_DROPPED_REMEMBERED:
                self._told.popitem(last=False)
        return f"{reason} (engine {self.ready.engine_id or '?'})"

    def stop(self) -> None:
        self._stop_event.set()
