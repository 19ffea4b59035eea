"""A client's session with the engine core, kept by a thread that owns the socket.

One implementation for both clients (``client.EngineCoreClient``, ``async_client.EngineClient``):

* ``Session`` — the rules, with no sockets and no clock of its own: handshake
  (``Hello`` → ``Ready``), heartbeats every ``VT_HEARTBEAT_INTERVAL_S``, the silence timeout
  ``VT_HEARTBEAT_TIMEOUT_S``, ``EngineDead``, ``SessionUnknown`` (re-handshake) and
  reconnection. Unit tests drive it directly.
* ``SessionThread`` — the shell: a thread that owns the ZMQ DEALER, feeds ``Session``, and
  hands events to the client through ``emit`` (called on this thread). The client sends
  through ``SessionThread.send`` (an inproc PUSH, from one owner thread). So heartbeats and
  the liveness watch go on while the client's own thread or event loop is busy or blocked::

      owner thread ── send(message, epoch) ─▶ inproc PUSH/PULL ─▶ ┐
                                                                    SessionThread ⇄ DEALER ⇄ engine
      owner thread ◀── emit(event) (a queue, or call_soon_threadsafe) ◀┘

Each session is carried by a DEALER of its own whose routing id is 18 random bytes
(``secrets``), never logged: the engine core binds the session to that connection (and,
under CurveZMQ, to this client's public key), so nobody else can receive its outputs or
abort its requests. A lost session's socket is closed and a new one says Hello. The
thread also watches its socket's handshake events, so a client whose CurveZMQ key the
engine refuses learns it at once (``HandshakeFailed``) instead of waiting for a timeout.

Sessions are numbered (``epoch``). A message stamped with an older epoch than the current
session is dropped, never delivered into a new session: its session is gone, and the client
fails every request of a lost session itself (``SessionLost``).

Losing the engine (silence, ``EngineDead``, the ``engine_alive`` probe) is final unless
``reconnect`` is set, in which case the thread keeps saying ``Hello`` until an engine core
answers at the same address. ``SessionUnknown`` (the engine is alive but has no session for
this client) is never final: the client says ``Hello`` again at once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from vtllm import envs
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the thread wakes to heartbeat and check the timeout
_PROBE_S = 0.5  # how often the ``engine_alive`` probe is called
_STOP = b"stop"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class EngineDeadError(RuntimeError):
    """The engine core is not available: it died, fell silent past the heartbeat timeout,
    or dropped this client's session (the request is gone; the client reconnects)."""


class HandshakeError(RuntimeError):
    """The engine core refused the handshake or did not answer in time."""


class FrameTooLargeError(ValueError):
    """A message longer than the engine core reads (``Ready.max_frame_bytes``): not sent."""


@dataclass(frozen=True)
class SessionUp:
    """A session is open (the first, or a new one after a loss). Stamp sends with ``epoch``."""

    ready: m.Ready
    epoch: int


@dataclass(frozen=True)
class SessionLost:
    """The session is gone and so is every request sent in it. ``final``: no new session
    will follow (the client is dead); else the thread is already saying Hello again."""

    reason: str
    final: bool


@dataclass(frozen=True)
class HandshakeFailed:
    """No first session: refused, wrong protocol version, or the engine process exited."""

    reason: str


Event = SessionUp | SessionLost | HandshakeFailed | m.EngineOutputs | m.UtilityResponse


class State(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    CLOSED = "closed"


class Session:
    """The client side of the session rules. ``send(message) -> bool`` (False: no
    connection to send on yet) and ``emit(event)`` are the only effects; time comes in as
    ``now`` (``time.monotonic()`` seconds)."""

    def __init__(
        self,
        client_name: str,
        send: Callable[[msgspec.Struct], bool],
        emit: Callable[[Event], None],
        *,
        interval_s: float,
        timeout_s: float,
        reconnect: bool,
        renew: Callable[[], None] = lambda: None,
    ) -> None:
        """``renew``: replace the connection (a fresh routing id) before a new Hello."""
        self.client_name = client_name
        self._send = send
        self._emit = emit
        self._renew = renew
        self.max_frame_bytes = 0  # the engine's limit, from its latest Ready (0: none said)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.reconnect = reconnect
        self.state = State.CONNECTING
        self.epoch = 0  # number of the open session; 0 before the first
        self._session_id = uuid.uuid4().hex
        self._next_hello = 0.0  # when to (re)send Hello while connecting
        self._next_beat = 0.0
        self._last_heard = 0.0
        self._last_tick = 0.0

    def accepts(self, epoch: int) -> bool:
        """Whether a message stamped ``epoch`` may go out now (its session is the open one)."""
        return self.state is State.READY and epoch == self.epoch

    def tick(self, now: float) -> None:
        if self._last_tick and now - self._last_tick > self.timeout_s / 2:
            # this process was not running (SIGSTOP, a suspended VM): a silence measured
            # meanwhile says nothing about the engine; give it a full timeout from now
            self._last_heard = max(self._last_heard, now)
        self._last_tick = now
        if self.state is State.CONNECTING:
            if now >= self._next_hello and self._send(
                m.Hello(m.PROTOCOL_VERSION, self.client_name, self._session_id)
            ):
                # sent (connected): the engine answers at once; ask again only if that is lost
                self._next_hello = now + self.timeout_s
        elif self.state is State.READY:
            if now - self._last_heard > self.timeout_s:
                self._lose(
                    f"engine core silent for more than {self.timeout_s:g}s "
                    "(VT_HEARTBEAT_TIMEOUT_S)",
                    final=not self.reconnect,
                    now=now,
                )
            elif now >= self._next_beat:
                self._send(m.Heartbeat(time.time()))
                self._next_beat = now + self.interval_s

    def on_message(self, message: m.EngineToClient, now: float) -> None:
        if self.state is State.CLOSED:
            return
        self._last_heard = now
        connecting = self.state is State.CONNECTING
        if isinstance(message, (m.EngineOutputs, m.UtilityResponse)):
            if not connecting:  # else: of a lost session, whose requests already failed
                self._emit(message)
        elif isinstance(message, m.Ready):
            if connecting:
                self._on_ready(message, now)
        elif isinstance(message, m.SessionUnknown):
            if not connecting:  # while connecting: an answer to a message of the lost session
                self._lose(
                    f"the engine core has no session for this client: {message.reason}",
                    final=False,
                    now=now,
                )
        elif isinstance(message, m.HandshakeRefused):
            self._refused(f"engine core refused the connection: {message.reason}", now)
        elif isinstance(message, m.EngineDead):
            if connecting:
                self._refused(f"engine core refused the connection: {message.reason}", now)
            else:
                # it is going down: a Hello at once could reach it before it is gone (a
                # restarted engine core loads its model first, which takes longer anyway)
                self._lose(
                    f"engine core died: {message.reason}",
                    final=not self.reconnect,
                    now=now,
                    hello_after_s=self.timeout_s,
                )

    def on_handshake_failed(self, reason: str, now: float) -> None:
        """The transport handshake failed (CurveZMQ key refused, mechanism mismatch):
        fatal before the first session; later, the engine is asked again after a timeout."""
        if self.state is State.CONNECTING and self.epoch == 0:
            self._fail_handshake(reason)

    def on_engine_exited(self, now: float) -> None:
        """The ``engine_alive`` probe said the engine process is gone: final."""
        if self.state is State.CLOSED:
            return
        if self.epoch == 0:
            self._fail_handshake("engine core process exited before it became ready")
        else:
            self._lose("engine core process exited", final=True, now=now)

    # -- transitions ----------------------------------------------------------------------

    def _on_ready(self, ready: m.Ready, now: float) -> None:
        if ready.protocol_version != m.PROTOCOL_VERSION:
            self._refused(
                f"engine core speaks protocol {ready.protocol_version}, this client speaks "
                f"{m.PROTOCOL_VERSION}; run matching vtllm versions",
                now,
            )
            return
        self.state = State.READY
        self.epoch += 1
        self.max_frame_bytes = ready.max_frame_bytes
        self._next_beat = now + self.interval_s
        self._emit(SessionUp(ready, self.epoch))

    def _refused(self, reason: str, now: float) -> None:
        if self.epoch == 0:
            self._fail_handshake(reason)
            return
        if self.state is State.READY:
            self.state = State.CONNECTING
        # an engine that came back refusing us (another version): say so, ask again later
        self._next_hello = now + self.timeout_s
        self._emit(SessionLost(f"{reason}; asking again every {self.timeout_s:g}s", False))

    def _fail_handshake(self, reason: str) -> None:
        self.state = State.CLOSED
        self._emit(HandshakeFailed(reason))

    def _lose(self, reason: str, *, final: bool, now: float, hello_after_s: float = 0.0) -> None:
        if final:
            self.state = State.CLOSED
        else:
            self.state = State.CONNECTING
            self._session_id = uuid.uuid4().hex
            self._renew()  # the new session gets a connection (and routing id) of its own
            self._next_hello = now + hello_after_s  # at once by default: a live engine
            self.tick(now)  # answers within milliseconds
        self._emit(SessionLost(reason, final))


class SessionThread(threading.Thread):
    """Owns the DEALER socket of one client: runs ``Session`` and the socket I/O.

    ``emit`` is called on this thread, in order. ``send``/``stop`` belong to the thread
    that created this object (a ZMQ socket serves one thread at a time)."""

    def __init__(
        self,
        address: str,
        client_name: str,
        emit: Callable[[Event], None],
        *,
        curve_keys: transport.ClientKeys | None = None,
        engine_alive: Callable[[], bool] | None = None,
        reconnect: bool = False,
        linger_ms: int = 200,
    ) -> None:
        super().__init__(name=f"vtllm-session-{client_name}", daemon=True)
        self.address = address
        self._emit = emit
        self._curve_keys = curve_keys
        self._engine_alive = engine_alive
        self._linger_ms = linger_ms
        self._ctx = zmq.Context()
        pipe_address = f"inproc://vtllm-session-{uuid.uuid4().hex}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(pipe_address)  # bound before the PUSH connects
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(pipe_address)
        self._dealer: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._logged_failure = ""
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self.session = Session(
            client_name or f"client-{os.getpid()}",
            self._send_now,
            emit,
            interval_s=envs.VT_HEARTBEAT_INTERVAL_S,
            timeout_s=envs.VT_HEARTBEAT_TIMEOUT_S,
            reconnect=reconnect,
            renew=self._open_dealer,
        )

    # -- owner thread ---------------------------------------------------------------------

    def send(self, message: msgspec.Struct, epoch: int) -> None:
        """Queue ``message`` for the session ``epoch``; dropped if that session is gone
        (its loss is, or will be, emitted as ``SessionLost``). Raises
        ``FrameTooLargeError`` for a message longer than the engine core reads."""
        frame = codec.encode(message)
        limit = self.session.max_frame_bytes
        if limit and len(frame) > limit:
            raise FrameTooLargeError(
                f"this {type(message).__name__} encodes to {len(frame)} bytes; the engine core "
                f"reads at most {limit} bytes per message (its --engine-max-frame-bytes)"
            )
        frames = [epoch.to_bytes(8, "little"), frame]
        with contextlib.suppress(zmq.Again):  # the thread has ended: the client is dead
            self._push.send_multipart(frames, zmq.NOBLOCK, copy=False)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Flush what was sent, close the socket and join (idempotent)."""
        if not self._push.closed:
            with contextlib.suppress(zmq.Again):
                self._push.send(_STOP, zmq.NOBLOCK)
            self._push.close()
        if self.is_alive():
            self.join(timeout_s)
        if not self.is_alive():
            self._ctx.term()

    # -- this thread ----------------------------------------------------------------------

    def _send_now(self, message: msgspec.Struct) -> bool:
        return self._send_frame(codec.encode(message))

    def _send_frame(self, frame: bytes | zmq.Frame) -> bool:
        assert self._dealer is not None
        try:
            self._dealer.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:  # not connected (ZMQ_IMMEDIATE: nothing queues for a missing peer)
            return False

    def _open_dealer(self) -> None:
        """A new connection with a fresh secret routing id (closing the previous one: what
        was queued on it belonged to a lost session)."""
        self._close_dealer(linger_ms=0)
        identity = b"vt" + secrets.token_bytes(16)  # never starts with 0 (libzmq's own ids)
        dealer = transport.configure(self._ctx.socket(zmq.DEALER), identity=identity)
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        transport.secure_client(dealer, self._curve_keys)
        self._monitor = dealer.get_monitor_socket(_HANDSHAKE_FAILED)
        dealer.connect(self.address)
        self._dealer = dealer
        self._poller.register(dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _close_dealer(self, linger_ms: int) -> None:
        if self._dealer is None:
            return
        assert self._monitor is not None
        self._poller.unregister(self._dealer)
        self._poller.unregister(self._monitor)
        self._dealer.disable_monitor()
        self._monitor.close(linger=0)
        self._dealer.close(linger=linger_ms)
        self._dealer = self._monitor = None

    def run(self) -> None:
        self._open_dealer()
        decoder = codec.engine_to_client_decoder()
        session = self.session
        next_probe = 0.0
        stopping = False
        try:
            while not stopping and session.state is not State.CLOSED:
                events = dict(self._poller.poll(int(_POLL_S * 1000)))
                if self._monitor in events:
                    self._on_monitor(session)
                if self._dealer in events:
                    self._receive(decoder, session)
                if self._pull in events:
                    stopping = self._forward(session)
                now = time.monotonic()
                if self._engine_alive is not None and now >= next_probe:
                    next_probe = now + _PROBE_S
                    if not self._engine_alive():
                        session.on_engine_exited(now)
                session.tick(now)
        except Exception as e:  # a socket failure: nothing more can reach the engine
            logger.exception("engine session thread failed")
            if session.state is not State.CLOSED:
                session.state = State.CLOSED
                self._emit(SessionLost(f"engine client failed: {e!r}", True))
        finally:
            self._close_dealer(linger_ms=self._linger_ms if stopping else 0)
            self._pull.close(linger=0)

    def _on_monitor(self, session: Session) -> None:
        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = f"the engine core at {self.address} refused the connection: " + (
                f"it does not admit this client's CurveZMQ key (status {event['value']}); "
                "add it with `vtllm keygen client --server ENGINE_KEY_FILE`"
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                else "the security handshake failed (one side uses CurveZMQ keys and the "
                "other not, or this client's key file names another engine's public key)"
            )
            if session.epoch == 0:
                session.on_handshake_failed(reason, time.monotonic())
            elif reason != self._logged_failure:  # once, not at every reconnection
                self._logged_failure = reason
                logger.warning("%s", reason)
            if session.state is State.CLOSED:
                return

    def _receive(self, decoder: codec.Decoder, session: Session) -> None:
        dealer = self._dealer  # a lost session replaces it: then stop reading the old one
        while dealer is not None and dealer is self._dealer:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:  # of a multipart message only the last frame is the message
                message = decoder.decode(frames[-1].buffer)
            except codec.ProtocolError as e:
                logger.warning("dropping an undecodable frame from the engine core: %s", e)
                continue
            session.on_message(message, time.monotonic())

    def _forward(self, session: Session) -> bool:
        """Send what the owner queued. True when it asked to stop."""
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            if len(frames) == 1:  # _STOP: everything queued before it has been sent
                return True
            epoch = int.from_bytes(frames[0].bytes, "little")
            if session.accepts(epoch) and not self._send_frame(frames[1]):
                logger.warning("engine core not connected; a message was dropped")
