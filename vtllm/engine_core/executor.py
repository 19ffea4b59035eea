"""Runs steps on the worker processes: one per tensor-parallel rank.

The engine core never imports torch: workers are started by module path in spawned
processes, and every exchange is a protocol message over one ROUTER socket (workers
connect DEALERs with identity ``rank-N``).

Start-up RPC: spawn → each rank sends ``WorkerReport`` → ``InitKVCache`` → ``WorkerReady``.
Each step: ``SchedulerOutput`` to every rank → rank 0 answers ``ModelRunnerOutput``.
``submit`` sends a step and ``collect`` waits for the oldest one's answer, so the engine
core can send step N+1 before it waits for step N (async scheduling); ``execute`` is the
two in one.
Grammars (structured outputs), outside steps: ``CompileGrammar`` / ``ReleaseGrammars`` to
rank 0; its ``GrammarReady`` answers arrive whenever a compile ends and are kept, like
heartbeats, whatever the executor was waiting for (``take_grammar_results``).

Nothing here waits without a deadline; each way a worker can fail raises
``WorkerDiedError`` with a message that says which:

=========================================  ============================================
the worker process exited, or sent          within about a second
``WorkerFailure``
its heartbeat thread fell silent (process   ``VT_WORKER_HEARTBEAT_TIMEOUT_S``
frozen: SIGSTOP, a debugger, gone)
it beats but a step does not finish         ``VT_STEP_TIMEOUT_S`` (a hung device/kernel),
                                            counted from when the step before it was
                                            collected (or from its submission, if later)
it beats but a start-up phase (loading,     ``VT_WORKER_START_TIMEOUT_S`` per phase,
profiling, graph capture) does not end      naming the phase
=========================================  ============================================

Under tensor parallelism a rank's death first fails its peers' collectives; the error names
the rank that exited, not the survivor that reported the failed collective.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from vtllm import envs
from vtllm.config import VtllmConfig
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)

WORKER_ENTRY = "vtllm.worker.worker:run_worker"
_POLL_MS = 200
# how long a rank's failure waits for another rank's process to be seen exited (its sockets
# close, failing the survivors' collectives, a moment before it can be reaped)
_PEER_EXIT_GRACE_S = 0.5


class WorkerDiedError(RuntimeError):
    """A worker process exited, failed, froze or hung; the engine cannot go on."""


@dataclass
class WorkerLiveness:
    """What the engine core last heard from one worker's heartbeat thread."""

    last_beat: float | None = None  # monotonic; None until the first beat
    phase: str = "starting the process"
    phase_started: float = 0.0  # monotonic, estimated from the beat's phase_elapsed_s


_PROCESS_STATES = {
    "T": "stopped (SIGSTOP or job control)",
    "t": "stopped by a debugger",
    "D": "in uninterruptible sleep (waiting on a device or disk)",
    "Z": "a zombie (exited, not yet reaped)",
    "R": "running",
    "S": "sleeping",
}


def process_state(pid: int | None) -> str:
    """The kernel's view of a process (Linux ``/proc``), for error messages; "" elsewhere."""
    if pid is None or not sys.platform.startswith("linux"):
        return ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _PROCESS_STATES.get(state, f"in state {state}")


def _entry(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _spawn_worker(entry: str, *args: Any) -> None:
    """Top-level target of a worker process (resolves the entry in the child)."""
    _entry(entry)(*args)


class MultiprocExecutor:
    def __init__(
        self,
        config: VtllmConfig,
        model_dir: str,
        worker_address: str,
        dist_init_address: str,
        worker_entry: str = WORKER_ENTRY,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.worker_address = worker_address
        self.dist_init_address = dist_init_address
        self.worker_entry = worker_entry
        self.world_size = config.parallel.tensor_parallel_size
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._ctx = zmq.Context.instance()
        self._socket = transport.configure(self._ctx.socket(zmq.ROUTER))
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._decoder = codec.worker_to_engine_decoder()
        self._identities = [f"rank-{r}".encode() for r in range(self.world_size)]
        self.liveness = [WorkerLiveness() for _ in range(self.world_size)]
        self._spawned_at = 0.0
        self._next_liveness_check = 0.0
        self._grammar_results: list[m.GrammarReady] = []
        # submitted steps not collected yet, oldest first: (step_id, tokens, submitted at)
        self._in_flight: deque[tuple[int, int, float]] = deque()
        self._last_collected = 0.0  # monotonic time the last step's result came in
        # step results read before ``collect`` asked for them (while submitting the next
        # step, or while waiting for grammars), by step id
        self._early_results: dict[int, m.ModelRunnerOutput] = {}

    # -- start-up --------------------------------------------------------------------

    def start(self) -> list[m.WorkerReport]:
        """Spawn the workers and wait until each has loaded the model and reported."""
        self._socket.bind(self.worker_address)
        ctx = multiprocessing.get_context("spawn")
        config_bytes = self.config.to_bytes()
        self._spawned_at = time.monotonic()
        for rank in range(self.world_size):
            process = ctx.Process(
                target=_spawn_worker,
                args=(
                    self.worker_entry,
                    config_bytes,
                    self.model_dir,
                    rank,
                    self.world_size,
                    self.worker_address,
                    self.dist_init_address,
                ),
                name=f"VTLLM::Worker_TP{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)
        reports = self._gather(m.WorkerReport)
        return [reports[r] for r in range(self.world_size)]

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._broadcast(m.InitKVCache(num_blocks=num_blocks, block_size=block_size))
        self._gather(m.WorkerReady)
        now = time.monotonic()
        for live in self.liveness:  # from now on silence counts, even if none beat yet
            if live.last_beat is None:
                live.last_beat = now

    def _gather(self, kind: type) -> dict[int, Any]:
        """Wait for one ``kind`` message from every rank, each start-up phase of each
        rank bounded by ``VT_WORKER_START_TIMEOUT_S`` (see ``_check_start_phases``)."""
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            self._check_start_phases([r for r in range(self.world_size) if r not in got])
            message = self._recv()
            if message is None:
                continue
            if not isinstance(message, kind):
                raise WorkerDiedError(f"expected {kind.__name__} from workers, got {message!r}")
            got[message.rank] = message
        return got

    def _check_start_phases(self, pending_ranks: list[int]) -> None:
        """Raise if a pending rank has spent longer than the bound in one start-up phase
        (or, before its first heartbeat, since it was spawned)."""
        limit = envs.VT_WORKER_START_TIMEOUT_S
        now = time.monotonic()
        for rank in pending_ranks:
            live = self.liveness[rank]
            since = self._spawned_at if live.last_beat is None else live.phase_started
            if now - since > limit:
                raise WorkerDiedError(
                    f"worker rank {rank} spent more than {limit:.0f}s {live.phase} "
                    f"(start-up phase limit VT_WORKER_START_TIMEOUT_S={limit:g}s; raise it "
                    "if this model is just slow to load, profile or capture)"
                )

    # -- steps -----------------------------------------------------------------------

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        """Run one step: ``submit`` then ``collect``."""
        self.submit(step)
        return self.collect()

    def submit(self, step: m.SchedulerOutput) -> None:
        """Send one step to every rank without waiting for its result. Raises
        ``WorkerDiedError`` when a worker cannot be reached or failed meanwhile."""
        self._absorb_queued()
        self._broadcast(step)
        num_tokens = sum(step.num_scheduled_tokens.values())
        self._in_flight.append((step.step_id, num_tokens, time.monotonic()))

    def collect(self) -> m.ModelRunnerOutput:
        """The oldest submitted step's result; raises ``WorkerDiedError`` if it has not
        finished within ``VT_STEP_TIMEOUT_S`` (counted from its submission, or from the
        collection of the step before it if that came later: the workers run steps one
        after the other) or a worker dies or freezes meanwhile."""
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        step_id, num_tokens, submitted = self._in_flight[0]
        timeout_s = envs.VT_STEP_TIMEOUT_S
        started = max(submitted, self._last_collected)
        early = self._early_results.pop(step_id, None)
        if early is not None:
            return self._collected(early)
        while True:
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                raise WorkerDiedError(
                    f"step {step_id} ({num_tokens} tokens) "
                    f"did not finish within VT_STEP_TIMEOUT_S={timeout_s:g}s although the "
                    f"workers are alive ({self.describe_liveness()}): the device or a "
                    "kernel is hung. Raise VT_STEP_TIMEOUT_S if steps are legitimately "
                    "this slow"
                )
            message = self._recv()
            if message is None:
                continue
            if isinstance(message, m.ModelRunnerOutput) and message.step_id == step_id:
                return self._collected(message)
            self._keep_or_ignore(message)

    def _collected(self, result: m.ModelRunnerOutput) -> m.ModelRunnerOutput:
        self._in_flight.popleft()
        self._last_collected = time.monotonic()
        return result

    def _keep_or_ignore(self, message: Any) -> None:
        """Keep the result of a step in flight for its ``collect``; log anything else."""
        in_flight = {step_id for step_id, _, _ in self._in_flight}
        if isinstance(message, m.ModelRunnerOutput) and message.step_id in in_flight:
            self._early_results[message.step_id] = message
        else:
            logger.warning("ignoring unexpected worker message %r", type(message).__name__)

    def _absorb_queued(self) -> None:
        """Read what the workers sent while the engine was idle (heartbeats pile up in the
        socket while no step runs), so that a long idle spell is not taken for silence.
        Raises ``WorkerDiedError`` for a queued ``WorkerFailure``."""
        while self._socket.poll(0):
            message = self._read_one()
            if message is not None:
                self._keep_or_ignore(message)

    # -- grammars (structured outputs) -----------------------------------------------

    def compile_grammar(self, request_id: str, seq: int, spec: m.StructuredOutputSpec) -> None:
        """Ask the driver (rank 0, which owns grammar state) to compile ``spec`` now; its
        ``GrammarReady`` comes back through ``take_grammar_results``. Never raises: a
        worker that is gone is reported by the next step or ``take_grammar_results``."""
        try:
            self._send(self._identities[0], m.CompileGrammar(request_id, seq, spec))
        except WorkerDiedError as e:
            logger.warning("grammar compile not delivered: %s", e)

    def release_grammars(self, request_ids: list[str]) -> None:
        """Tell the driver these requests ended. Best effort: a worker that is gone has
        nothing left to forget (its death is reported by the next step or poll)."""
        try:
            self._send(self._identities[0], m.ReleaseGrammars(request_ids))
        except WorkerDiedError as e:
            logger.debug("grammar release not delivered: %s", e)

    def take_grammar_results(self, wait_s: float = 0.0) -> list[m.GrammarReady]:
        """The ``GrammarReady`` answers received so far (each returned once); when none
        is in yet, waits for worker messages up to ``wait_s``. Raises
        ``WorkerDiedError`` as ``execute`` does if a worker died or fell silent."""
        self._absorb_queued()
        if not self._grammar_results and wait_s > 0:
            now = time.monotonic()
            if now >= self._next_liveness_check:
                self._next_liveness_check = now + _POLL_MS / 1000
                self.check_alive()
            if self._socket.poll(max(1, int(wait_s * 1000))):
                self._absorb_queued()
        results, self._grammar_results = self._grammar_results, []
        return results

    def _send(self, identity: bytes, message: Any) -> None:
        try:
            self._socket.send_multipart([identity, codec.encode(message)], copy=False)
        except zmq.ZMQError as e:
            raise WorkerDiedError(self._describe_unreachable(identity, e)) from None

    def _broadcast(self, message: Any) -> None:
        payload = codec.encode(message)
        for identity in self._identities:
            try:
                self._socket.send_multipart([identity, payload], copy=False)
            except zmq.ZMQError as e:
                raise WorkerDiedError(self._describe_unreachable(identity, e)) from None

    def _describe_unreachable(self, identity: bytes, error: zmq.ZMQError) -> str:
        """Why a send to ``identity`` failed: ZMQ drops a peer whose process died
        ("Host unreachable") possibly before the exit is seen, so when that rank's
        process has exited (or does within ``_PEER_EXIT_GRACE_S``) the exit is named."""
        name = identity.decode(errors="replace")
        rank = self._identities.index(identity) if identity in self._identities else None
        if rank is not None and rank < len(self.processes):
            process = self.processes[rank]
            process.join(_PEER_EXIT_GRACE_S)
            if not process.is_alive():
                return (
                    f"worker rank {rank} (pid {process.pid}) exited with code "
                    f"{process.exitcode} (then unreachable: {error})"
                )
        return f"cannot reach worker {name}: {error}"

    def _recv(self) -> Any:
        """One decoded worker message, or None after a poll interval with nothing (or
        after a heartbeat, which it records).

        Raises ``WorkerDiedError`` if a worker failed, its process is gone, or its
        heartbeat fell silent.
        """
        now = time.monotonic()
        if now >= self._next_liveness_check:
            self._next_liveness_check = now + _POLL_MS / 1000
            self.check_alive()
        if not self._socket.poll(_POLL_MS):
            return None
        return self._read_one()

    def _read_one(self) -> Any:
        """Decode one waiting message as ``_recv`` does (heartbeats recorded → None)."""
        frames = self._socket.recv_multipart()
        if len(frames) != 2:
            logger.warning("dropping a worker message of %d frames", len(frames))
            return None
        try:
            message = self._decoder.decode(frames[1])
        except codec.ProtocolError as e:
            logger.warning("dropping an undecodable worker message: %s", e)
            return None
        if isinstance(message, m.WorkerFailure):
            raise WorkerDiedError(self._describe_failure(message))
        if isinstance(message, m.WorkerHeartbeat):
            self._on_heartbeat(message)
            return None
        if isinstance(message, m.GrammarReady):
            self._grammar_results.append(message)
            return None
        return message

    def _describe_failure(self, failure: m.WorkerFailure) -> str:
        """What ``failure`` means. Under tensor parallelism the death of one rank shows up
        first as a collective error in the others (gloo: "Connection closed by peer"),
        which would blame a healthy rank; so when another rank's process has exited (or
        does within ``_PEER_EXIT_GRACE_S``), that exit is named as the cause."""
        deadline = time.monotonic() + _PEER_EXIT_GRACE_S
        for rank, process in enumerate(self.processes):
            if rank == failure.rank:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if not process.is_alive():
                first_line = failure.message.split("\n", 1)[0][:300]
                return (
                    f"worker rank {rank} (pid {process.pid}) exited with code "
                    f"{process.exitcode}; rank {failure.rank} then failed: {first_line}"
                )
        return f"worker rank {failure.rank} failed: {failure.message}"

    def _on_heartbeat(self, beat: m.WorkerHeartbeat) -> None:
        if not 0 <= beat.rank < self.world_size:
            logger.warning("dropping a heartbeat from unknown worker rank %d", beat.rank)
            return
        live = self.liveness[beat.rank]
        now = time.monotonic()
        live.last_beat = now
        if beat.phase != live.phase or live.phase_started == 0.0:
            live.phase = beat.phase
            live.phase_started = now - max(0.0, beat.phase_elapsed_s)

    def check_alive(self) -> None:
        """Raise ``WorkerDiedError`` if a worker process exited or its heartbeat has been
        silent for longer than ``VT_WORKER_HEARTBEAT_TIMEOUT_S``."""
        silence_limit = envs.VT_WORKER_HEARTBEAT_TIMEOUT_S
        now = time.monotonic()
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerDiedError(
                    f"worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                )
            last_beat = self.liveness[rank].last_beat
            if last_beat is not None and now - last_beat > silence_limit:
                state = process_state(process.pid)
                raise WorkerDiedError(
                    f"worker rank {rank} (pid {process.pid}) sent no heartbeat for "
                    f"{now - last_beat:.1f}s (VT_WORKER_HEARTBEAT_TIMEOUT_S={silence_limit:g}s)"
                    + (f"; the process is {state}" if state else "")
                    + f"; it was {self._phase_of(rank)}"
                )

    def _phase_of(self, rank: int) -> str:
        """What ``rank`` was doing, by its last heartbeat, or "serving" while a step is in
        flight: steps are sent only after start-up, and a worker frozen (SIGSTOP) right
        after its phase change can stop before its I/O thread sends the beat that says so
        (seen in CI: "it was waiting for the KV cache size" during a step)."""
        phase = self.liveness[rank].phase
        if self._in_flight and phase != "serving":
            return f"serving (its last heartbeat said: {phase})"
        return phase

    def describe_liveness(self) -> str:
        """One line per rank of what its heartbeats say, for logs and errors."""
        now = time.monotonic()
        parts = []
        for rank, live in enumerate(self.liveness):
            if live.last_beat is None:
                parts.append(f"rank {rank}: no heartbeat yet")
            else:
                parts.append(
                    f"rank {rank}: {live.phase} for {now - live.phase_started:.0f}s, "
                    f"last heartbeat {now - live.last_beat:.1f}s ago"
                )
        return "; ".join(parts)

    # -- shutdown --------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the workers to exit, then make sure they did; remove the socket file."""
        with contextlib.suppress(WorkerDiedError):
            self._broadcast(m.Shutdown())
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                logger.warning("worker pid %d did not exit; killing it", process.pid)
                process.kill()
                process.join(2.0)
        self._socket.close(linger=0)
        transport.unlink_ipc(self.worker_address)
