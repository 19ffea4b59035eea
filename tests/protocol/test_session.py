"""The session rules (``session.Session``) driven directly: no sockets, time passed in."""

from __future__ import annotations

import pytest

from vtllm.protocol import messages as m
from vtllm.protocol.session import (
    HandshakeFailed,
    Session,
    SessionLost,
    SessionUp,
    State,
)

READY = m.Ready(m.PROTOCOL_VERSION, "model", 256, 1000, 64, 16, [2], "e1")
T0 = 100.0


class Wire:
    """What the session sent and emitted; ``connected`` says whether a send goes out."""

    def __init__(self) -> None:
        self.connected = True
        self.sent: list[object] = []
        self.events: list[object] = []

    def send(self, message: object) -> bool:
        if self.connected:
            self.sent.append(message)
        return self.connected

    def hellos(self) -> list[m.Hello]:
        return [s for s in self.sent if isinstance(s, m.Hello)]


def _session(reconnect: bool = False, interval_s: float = 1.0, timeout_s: float = 5.0):
    wire = Wire()
    session = Session(
        "t",
        wire.send,
        wire.events.append,
        interval_s=interval_s,
        timeout_s=timeout_s,
        reconnect=reconnect,
    )
    return session, wire


def _run(session: Session, start: float, end: float, step: float = 0.1) -> None:
    """Tick as the thread does, every ``step`` seconds from ``start`` to ``end``."""
    now = start
    while now < end - 1e-9:
        now = min(now + step, end)
        session.tick(T0 + now)


def _open(reconnect: bool = False) -> tuple[Session, Wire]:
    session, wire = _session(reconnect)
    session.tick(T0)
    session.on_message(READY, T0)
    assert wire.events == [SessionUp(READY, 1)]
    wire.events.clear()
    return session, wire


def test_hello_waits_for_a_connection_and_is_not_repeated_while_answered():
    session, wire = _session()
    wire.connected = False
    session.tick(T0)
    session.tick(T0 + 0.1)
    assert wire.sent == []  # nothing queued for an engine that is not there
    wire.connected = True
    session.tick(T0 + 0.2)
    session.tick(T0 + 0.3)
    assert len(wire.hellos()) == 1  # a connected engine answers; no duplicate Hello
    session.tick(T0 + 0.2 + 5.1)
    assert len(wire.hellos()) == 2  # unanswered for a timeout: ask again, same session id
    assert wire.hellos()[0].session_id == wire.hellos()[1].session_id
    session.on_message(READY, T0 + 6)
    assert wire.events == [SessionUp(READY, 1)] and session.state is State.READY


def test_heartbeats_every_interval_and_silence_is_final_without_reconnect():
    session, wire = _open()
    _run(session, 0, 4.95)
    beats = [s for s in wire.sent if isinstance(s, m.Heartbeat)]
    assert len(beats) == 4  # at 1, 2, 3, 4 s
    assert wire.events == [] and session.state is State.READY  # 5 s not yet exceeded
    _run(session, 4.95, 5.05)
    assert len(wire.events) == 1 and wire.events[0].final
    assert "silent for more than 5s" in wire.events[0].reason
    assert session.state is State.CLOSED and not session.accepts(1)


def test_any_message_keeps_the_session_alive():
    session, wire = _open()
    for i in range(1, 100):
        now = T0 + i * 0.1
        if i % 40 == 0:
            session.on_message(m.Heartbeat(0.0), now)
        session.tick(now)
    assert wire.events == [] and session.state is State.READY


def test_silence_with_reconnect_says_hello_again_with_a_new_session():
    session, wire = _open(reconnect=True)
    _run(session, 0, 5.2)
    assert wire.events == [SessionLost(wire.events[0].reason, False)]
    assert session.state is State.CONNECTING and not session.accepts(1)
    first, second = wire.hellos()
    assert first.session_id != second.session_id
    session.on_message(m.EngineOutputs([m.RequestOutput("old", [1])]), T0 + 5.3)
    assert len(wire.events) == 1  # outputs of the lost session are not delivered
    session.on_message(READY, T0 + 5.4)
    assert wire.events[-1] == SessionUp(READY, 2) and session.accepts(2)
    assert not session.accepts(1)  # messages stamped for the lost session are dropped


def test_session_unknown_re_handshakes_at_once_even_without_reconnect():
    session, wire = _open(reconnect=False)
    session.on_message(m.SessionUnknown("this client was silent for 6s"), T0 + 1)
    lost = wire.events[0]
    assert isinstance(lost, SessionLost) and not lost.final
    assert "no session for this client: this client was silent for 6s" in lost.reason
    assert len(wire.hellos()) == 2  # the new Hello went out at once
    session.on_message(m.SessionUnknown("late answer to an old heartbeat"), T0 + 1.01)
    assert len(wire.events) == 1  # ignored while connecting
    session.on_message(READY, T0 + 1.02)
    assert wire.events[-1] == SessionUp(READY, 2)


def test_engine_dead_is_final_without_reconnect_and_not_with_it():
    session, wire = _open(reconnect=False)
    session.on_message(m.EngineDead("worker 0 died"), T0 + 1)
    assert wire.events == [SessionLost("engine core died: worker 0 died", True)]
    session, wire = _open(reconnect=True)
    _run(session, 0, 1)
    session.on_message(m.EngineDead("stopping"), T0 + 1)
    assert wire.events == [SessionLost("engine core died: stopping", False)]
    assert session.state is State.CONNECTING
    # not straight back to the engine core that is going down: after a timeout
    _run(session, 1, 5.9)
    assert len(wire.hellos()) == 1
    _run(session, 5.9, 6.1)
    assert len(wire.hellos()) == 2


def test_probe_exit_is_final_even_with_reconnect():
    session, wire = _open(reconnect=True)
    session.on_engine_exited(T0 + 1)
    assert wire.events == [SessionLost("engine core process exited", True)]
    session, wire = _session()
    session.on_engine_exited(T0)
    assert wire.events == [HandshakeFailed("engine core process exited before it became ready")]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (m.HandshakeRefused("version 0 is too old"), "version 0 is too old"),
        (m.Ready(99, "model", 256, 1000, 64, 16, [2]), "speaks protocol 99"),
    ],
)
def test_first_handshake_refused(answer, expected):
    session, wire = _session()
    session.tick(T0)
    session.on_message(answer, T0)
    assert len(wire.events) == 1 and isinstance(wire.events[0], HandshakeFailed)
    assert expected in wire.events[0].reason and session.state is State.CLOSED


def test_a_refusal_after_a_lost_session_keeps_asking():
    session, wire = _open(reconnect=True)
    session.on_message(m.EngineDead("restarting"), T0 + 1)
    session.on_message(m.HandshakeRefused("protocol 1 is not supported"), T0 + 2)
    assert isinstance(wire.events[-1], SessionLost) and not wire.events[-1].final
    assert session.state is State.CONNECTING
    hellos = len(wire.hellos())
    session.tick(T0 + 6.5)
    assert len(wire.hellos()) == hellos  # asks again only after a timeout
    session.tick(T0 + 7.1)
    assert len(wire.hellos()) == hellos + 1


def test_own_stall_is_not_the_engines_silence():
    session, wire = _open()
    _run(session, 0, 1)
    session.tick(T0 + 40)  # this process was stopped for 39 s
    assert wire.events == [] and session.state is State.READY
    _run(session, 40, 44.9)
    assert wire.events == []
    _run(session, 44.9, 45.2)  # but silence after it counts
    assert wire.events and wire.events[0].final
