"""The engine core's client socket thread (``ClientChannel``) against raw DEALER sockets:
sessions open, repeat and end; silence drops a client, and a client without a session is
told so; an engine that is going down opens no new session."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import zmq

from vtllm.engine_core.client_channel import ClientChannel, ClientGone
from vtllm.protocol import codec
from vtllm.protocol import messages as m

READY = m.Ready(m.PROTOCOL_VERSION, "model", 256, 1000, 64, 16, [2], "engine-1")
PARAMS = m.SamplingParams(max_tokens=1)
C1, C2, C3, C4 = (f"client-{n}-routing-id".encode() for n in range(1, 5))  # >= 16 bytes


class Peer:
    """A raw client socket."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes) -> None:
        self.identity = identity
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.decoder = codec.engine_to_client_decoder()

    def send(self, message) -> None:
        self.sock.send(codec.encode(message))

    def recv(self, kind: type, timeout_s: float = 3.0):
        """The next message of ``kind`` (heartbeats skipped)."""
        while self.sock.poll(int(timeout_s * 1000)):
            message = self.decoder.decode(self.sock.recv())
            if not isinstance(message, m.Heartbeat):
                assert isinstance(message, kind), message
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s}s")


@pytest.fixture
def channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VT_HEARTBEAT_INTERVAL_S", "0.1")
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", "1.5")
    ctx = zmq.Context()
    inbox: queue.Queue = queue.Queue()
    chan = ClientChannel(ctx, f"ipc://{tmp_path}/engine.sock", READY, inbox)
    chan.start()
    assert chan.bound.wait(5)
    push = ctx.socket(zmq.PUSH)
    push.connect(chan.outbox_address)
    peers: list[Peer] = []

    def peer(identity: bytes) -> Peer:
        peers.append(Peer(ctx, chan.address, identity))
        return peers[-1]

    yield chan, inbox, push, peer
    for p in peers:
        p.sock.close()
    push.close(0)
    chan.stop()
    chan.join(5)
    ctx.term()


def _inbox_items(inbox: queue.Queue, timeout_s: float = 0.3) -> list:
    items = []
    try:
        while True:
            items.append(inbox.get(timeout=timeout_s))
    except queue.Empty:
        return items


def test_a_session_opens_repeats_and_ends(channel):
    _, inbox, _, peer = channel
    client = peer(C1)
    client.send(m.Hello(m.PROTOCOL_VERSION, "t", "session-a"))
    assert client.recv(m.Ready) == READY
    client.send(m.Hello(m.PROTOCOL_VERSION, "t", "session-a"))  # a repeat: same session
    assert client.recv(m.Ready) == READY
    client.send(m.AddRequest("r1", [1], PARAMS))
    assert [type(msg) for _, msg in _inbox_items(inbox)] == [m.AddRequest]
    client.send(m.Hello(m.PROTOCOL_VERSION, "t", "session-b"))  # a new session ends the old
    assert client.recv(m.Ready) == READY
    client.send(m.AddRequest("r2", [1], PARAMS))
    items = _inbox_items(inbox)
    assert [(i, type(msg)) for i, msg in items] == [(C1, ClientGone), (C1, m.AddRequest)]
    client.send(m.Goodbye())
    client.send(m.AddRequest("r3", [1], PARAMS))
    assert "said goodbye" in client.recv(m.SessionUnknown).reason
    assert [type(msg) for _, msg in _inbox_items(inbox)] == [ClientGone]


def test_a_silent_client_is_dropped_and_told_when_it_speaks(channel):
    _, inbox, _, peer = channel
    client = peer(C2)
    client.send(m.Hello(m.PROTOCOL_VERSION, "t", "s"))
    client.recv(m.Ready)
    gone = inbox.get(timeout=5)  # silent past 1.5 s
    assert gone[0] == C2 and isinstance(gone[1], ClientGone)
    client.send(m.Heartbeat(0.0))
    reason = client.recv(m.SessionUnknown).reason
    assert "was silent for" in reason and "the engine aborted its requests" in reason
    assert "(engine engine-1)" in reason
    client.send(m.Hello(m.PROTOCOL_VERSION, "t", "s2"))  # and it may come back
    client.recv(m.Ready)


def test_no_new_session_once_the_engine_sent_engine_dead(channel):
    _, _, push, peer = channel
    first = peer(C3)
    first.send(m.Hello(m.PROTOCOL_VERSION, "t", "s"))
    first.recv(m.Ready)
    push.send_multipart([C3, codec.encode(m.EngineDead("worker 0 died"))])
    assert first.recv(m.EngineDead).reason == "worker 0 died"
    second = peer(C4)
    second.send(m.Hello(m.PROTOCOL_VERSION, "t", "s"))
    refusal = second.recv(m.HandshakeRefused).reason
    assert refusal == "the engine core is going down: worker 0 died"
