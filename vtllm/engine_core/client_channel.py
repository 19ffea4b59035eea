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

Who owns a session (docs/PROTOCOL.md, "Security"): the connection whose routing id said
Hello. That id must be at least ``MIN_IDENTITY_BYTES`` random bytes, chosen by the client
for each session and never logged (logs show ``fingerprint(id)``), and the ROUTER has no
``ROUTER_HANDOVER``: a second connection presenting a live id is never attached by libzmq,
so it receives nothing and nothing it sends is read. Under CurveZMQ the session is also
bound to the client's public key (the frame's ``User-Id``): a message of that routing id
under another key is dropped.

Frames longer than ``max_frame_bytes`` are refused before decoding: an ``add`` (or
``util``) gets an error answer naming the limit; frames beyond ``HARD_FRAME_FACTOR`` times
the limit never reach this thread (libzmq drops the sender's connection before allocating
them; the client can only see its request go unanswered, which is why clients check the
limit advertised in ``Ready`` before sending).
"""

from __future__ import annotations

import hashlib
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
MIN_IDENTITY_BYTES = 16  # a routing id that a session may own: unguessable
HARD_FRAME_FACTOR = 4  # frames over this many times the limit: the connection is dropped
_MAX_ECHOED_ID_CHARS = 64 * 1024  # an oversized add's id is answered up to this length


def frame_limit(configured: int, max_model_len: int) -> int:
    """``--engine-max-frame-bytes``, or when 0 its default: 16 bytes per token of
    ``max_model_len``, at least 4 MiB. A prompt token costs at most 5 bytes (msgpack
    uint32), so a full-context prompt fits three times over; the floor holds the sampling
    lists at their bounds. Decoding a frame of the limit costs at most ~9 bytes of Python
    objects per byte (a list of small ints), so ~40 MiB at 4 MiB."""
    return configured or max(4 * 2**20, 16 * max_model_len)


def fingerprint(identity: bytes) -> str:
    """A short non-reversible name of a routing id, for logs (the id itself is a secret)."""
    return hashlib.blake2b(identity, digest_size=4).hexdigest()


def peek_head(payload: bytes | memoryview) -> tuple[str, str | int] | None:
    """(tag, first field) of an encoded message, read from its first bytes only (for
    answering a frame too long to decode); None when they are not a str tag followed by
    a str or a non-negative int."""
    data = memoryview(payload)[: 16 + _MAX_ECHOED_ID_CHARS]
    pos = 0

    def read_len(prefixes: dict[int, int]) -> int | None:
        nonlocal pos
        if pos >= len(data) or data[pos] not in prefixes:
            return None
        width = prefixes[data[pos]]
        value = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
        pos += 1 + width
        return value

    def read_str() -> str | None:
        nonlocal pos
        if pos < len(data) and 0xA0 <= data[pos] <= 0xBF:
            size, pos = data[pos] & 0x1F, pos + 1
        else:
            size = read_len({0xD9: 1, 0xDA: 2, 0xDB: 4})
        if size is None or pos + size > len(data):
            return None
        text = bytes(data[pos : pos + size]).decode("utf-8", "replace")
        pos += size
        return text

    if pos < len(data) and 0x92 <= data[pos] <= 0x9F:
        pos += 1
    elif read_len({0xDC: 2, 0xDD: 4}) is None:
        return None
    tag = read_str()
    if tag is None or pos >= len(data):
        return None
    if data[pos] <= 0x7F:
        return tag, int(data[pos])
    number = read_len({0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8})
    if number is not None:
        return tag, number
    first = read_str()
    return None if first is None else (tag, first)


@dataclass
class ClientGone:
    """Inbox item: a client said Goodbye or fell silent past the heartbeat timeout."""


@dataclass
class _Session:
    session_id: str
    name: str  # for logs: the Hello's client name and the id's fingerprint
    user_id: str | None  # the client's CurveZMQ public key (z85), when CURVE is on


class ClientChannel(threading.Thread):
    """Owns the client ROUTER socket: handshake, heartbeats, decode, send."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        ready: m.Ready,
        inbox: queue.Queue,
        curve_keys: transport.ServerKeys | None = None,
        max_frame_bytes: int = codec.MAX_FRAME_BYTES,
    ):
        super().__init__(name="vtllm-client-io", daemon=True)
        self.curve_keys = curve_keys
        self.max_frame_bytes = max_frame_bytes
        self.ctx = ctx
        self.address = address
        self.ready = ready
        self.inbox = inbox
        self.outbox_address = f"inproc://vtllm-outbox-{uuid.uuid4().hex}"
        self._outbox = ctx.socket(zmq.PULL)
        self._outbox.bind(self.outbox_address)  # bound before the loop's PUSH connects
        self._stop_event = threading.Event()
        self.clients: dict[ClientId, float] = {}  # identity → last heard (monotonic)
        self._sessions: dict[ClientId, _Session] = {}
        # why recent clients lost their session (answered with SessionUnknown), bounded
        self._dropped: OrderedDict[ClientId, str] = OrderedDict()
        self._told: OrderedDict[ClientId, None] = OrderedDict()  # warned about, bounded
        self.bound = threading.Event()
        self._going_down: str | None = None  # the EngineDead reason, once the loop sent it

    def run(self) -> None:
        # No ROUTER_HANDOVER: a routing id belongs to the connection that has it, so a
        # second connection presenting it is ignored instead of taking its session over.
        router = transport.configure(
            self.ctx.socket(zmq.ROUTER), max_frame_bytes=self.max_frame_bytes * HARD_FRAME_FACTOR
        )
        authenticator = transport.secure_server(router, self.curve_keys)
        transport.bind(router, self.address)
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
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
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
                                self._sessions[identity].name,
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
            logger.debug("cannot send to client %s: %s", fingerprint(identity), e)

    def _user_id(self, frame: zmq.Frame) -> str | None:
        return frame.get("User-Id") if self.curve_keys is not None else None

    def _on_frames(
        self, router: zmq.Socket, decoder: codec.Decoder, frames: list[zmq.Frame]
    ) -> None:
        if len(frames) != 2:
            logger.warning("dropping a client message of %d frames (expected 1)", len(frames) - 1)
            return
        identity, payload = frames[0].bytes, frames[1]
        session = self._sessions.get(identity)
        if session is not None and session.user_id != self._user_id(payload):
            logger.warning(
                "dropping a message for the session of client %s sent under another key",
                session.name,
            )
            return
        if len(payload) > self.max_frame_bytes:
            self._refuse_oversized(router, identity, payload)
            return
        try:
            message = decoder.decode(payload.buffer)
        except codec.ProtocolError as e:
            logger.warning(
                "dropping an undecodable message from client %s: %s", fingerprint(identity), e
            )
            return
        if isinstance(message, m.Hello):
            refusal = self._hello_refusal(identity, message)
            if refusal is not None:
                name = f"{message.client_name[:64]!r} [{fingerprint(identity)}]"
                logger.warning("refused client %s: %s", name, refusal)
                self._send(router, identity, codec.encode(m.HandshakeRefused(refusal)))
                return
            self._open_session(router, identity, message, self._user_id(payload))
            return
        if session is None:
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

    def _hello_refusal(self, identity: ClientId, hello: m.Hello) -> str | None:
        if hello.protocol_version != m.PROTOCOL_VERSION:
            return (
                f"protocol version {hello.protocol_version} is not supported; this "
                f"engine speaks version {m.PROTOCOL_VERSION}: upgrade the client"
            )
        if len(identity) < MIN_IDENTITY_BYTES:
            return (
                f"this connection's routing id has {len(identity)} bytes; a session needs an "
                f"unguessable one of at least {MIN_IDENTITY_BYTES} random bytes (set "
                "zmq.IDENTITY to secrets.token_bytes(16) before connecting; vtllm's clients do)"
            )
        if self._going_down is not None:  # no new session with an engine that is exiting
            return f"the engine core is going down: {self._going_down}"
        return None

    def _refuse_oversized(self, router: zmq.Socket, identity: ClientId, payload: zmq.Frame) -> None:
        """Answer a frame over the limit without decoding it: an ``add`` finishes with an
        error, a ``util`` call fails; anything else is dropped with a warning."""
        reason = (
            f"a message of {len(payload) / 2**20:.1f} MiB exceeds this engine core's limit "
            f"of {self.max_frame_bytes / 2**20:.1f} MiB per message (--engine-max-frame-bytes)"
        )
        head = peek_head(payload.buffer)
        session = self._sessions.get(identity)
        who = session.name if session is not None else fingerprint(identity)
        logger.warning("refused a message from client %s: %s", who, reason)
        if session is None:
            self._send(router, identity, codec.encode(m.SessionUnknown(self._unknown(identity))))
            return
        self.clients[identity] = time.monotonic()
        if head is not None and head[0] == "add" and isinstance(head[1], str):
            refusal = m.RequestOutput(
                request_id=head[1],
                new_token_ids=[],
                finish_reason=m.FinishReason.ERROR,
                error=reason,
                error_code=m.ErrorCode.INVALID_REQUEST,
            )
            self._send(router, identity, codec.encode(m.EngineOutputs([refusal])))
        elif head is not None and head[0] == "util" and isinstance(head[1], int):
            response = m.UtilityResponse(head[1], False, error=reason)
            self._send(router, identity, codec.encode(response))

    def _open_session(
        self, router: zmq.Socket, identity: ClientId, hello: m.Hello, user_id: str | None
    ) -> None:
        old = self._sessions.get(identity)
        same = old is not None and hello.session_id and old.session_id == hello.session_id
        if old is not None and not same:
            # the client lost its old session (it failed those requests): end it here too
            self._end_session(identity, "this client opened a new session")
        if not same:
            name = f"{hello.client_name[:64]!r} [{fingerprint(identity)}]"
            if user_id is not None and self.curve_keys is not None:
                name += f" (key {self.curve_keys.client_name(user_id)!r})"
            self._sessions[identity] = _Session(hello.session_id, name, user_id)
            logger.info("client %s connected", name)
        self.clients[identity] = time.monotonic()
        self._dropped.pop(identity, None)
        self._told.pop(identity, None)
        self._send(router, identity, codec.encode(self.ready))

    def _end_session(self, identity: ClientId, reason: str) -> None:
        """Forget the client; the loop aborts every request it still owns."""
        del self.clients[identity]
        self._sessions.pop(identity, None)
        self._dropped[identity] = reason
        while len(self._dropped) > _MAX_DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)
        self.inbox.put((identity, ClientGone()))

    def _unknown(self, identity: ClientId) -> str:
        reason = self._dropped.get(identity)
        if reason is None:  # never seen: e.g. this engine core started after the client's Hello
            reason = "it never said hello to this engine core (did the engine core restart?)"
        if identity not in self._told:  # once per client, not once per message
            logger.warning(
                "client %s has no session: %s; telling it", fingerprint(identity), reason
            )
            self._told[identity] = None
            while len(self._told) > _MAX_DROPPED_REMEMBERED:
                self._told.popitem(last=False)
        return f"{reason} (engine {self.ready.engine_id or '?'})"

    def stop(self) -> None:
        self._stop_event.set()
