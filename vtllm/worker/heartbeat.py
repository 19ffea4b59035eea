"""A worker's proof of life: a thread that tells the engine core, about once a second,
that the process runs and which phase its main thread is in.

It has a ZMQ socket of its own (sockets are not thread-safe, and the main thread's may
sit inside a long step), so a slow step still beats while a frozen process (SIGSTOP, a
debugger, swapped out) or a dead one falls silent. The engine core tells the two apart
from that silence (``executor.MultiprocExecutor``)::

    main thread  ── phase = "loading weights" ── "profiling memory" ── "serving" ──▶
    beat thread  ── WorkerHeartbeat{rank, phase, phase_elapsed_s} every interval ──▶ engine
"""

from __future__ import annotations

import contextlib
import threading
import time

import zmq

from vtllm.protocol import codec
from vtllm.protocol import messages as m

HEARTBEAT_INTERVAL_S = 1.0
ANNOUNCE_TIMEOUT_S = 1.0  # at most this long a phase change waits for its beat to leave


class HeartbeatSender(threading.Thread):
    """Start with ``start()``; set ``phase`` as the main thread moves on; ``stop()``."""

    def __init__(
        self, engine_address: str, rank: int, interval_s: float = HEARTBEAT_INTERVAL_S
    ) -> None:
        super().__init__(name=f"vtllm-worker-beat-{rank}", daemon=True)
        self.engine_address = engine_address
        self.rank = rank
        self.interval_s = interval_s
        self._phase = "starting"
        self._phase_started = time.monotonic()
        self._stopping = False
        self._wake = threading.Event()  # set by stop() and by a phase change
        self._announced = threading.Event()  # set once a beat has carried the current phase

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        """Enter a new phase; the engine core hears of it at once, not a beat later: a
        started sender's beat carrying it is queued on its socket when this returns (within
        ``ANNOUNCE_TIMEOUT_S``), so a process frozen right after (SIGSTOP) is reported in
        the phase it froze in, not the one before."""
        self._phase_started = time.monotonic()
        self._announced.clear()
        self._phase = value
        self._wake.set()
        if self.is_alive():
            self._announced.wait(ANNOUNCE_TIMEOUT_S)

    def run(self) -> None:
        context = zmq.Context.instance()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, f"rank-{self.rank}-beat".encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)  # beats are worthless once stale: drop, never pile up
        socket.connect(self.engine_address)
        try:
            while not self._stopping:
                self._wake.clear()
                phase = self._phase
                beat = m.WorkerHeartbeat(
                    rank=self.rank,
                    phase=phase,
                    phase_elapsed_s=round(time.monotonic() - self._phase_started, 3),
                )
                # the engine core not reading (zmq.Again) is its own timeout's business
                with contextlib.suppress(zmq.Again):
                    socket.send(codec.encode(beat), zmq.NOBLOCK)
                if phase == self._phase:
                    self._announced.set()
                self._wake.wait(self.interval_s)
        finally:
            socket.close(linger=0)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
