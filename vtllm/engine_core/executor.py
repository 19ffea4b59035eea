"""Runs steps on the worker processes: one per tensor-parallel rank.

The engine core never imports torch: workers are started by module path in spawned
processes, and every exchange is a protocol message over one ROUTER socket (workers
connect DEALERs with identity ``rank-N``).

Start-up RPC: spawn → each rank sends ``WorkerReport`` → ``InitKVCache`` → ``WorkerReady``.
Each step: ``SchedulerOutput`` to every rank → rank 0 answers ``ModelRunnerOutput``.
A worker that dies or reports ``WorkerFailure`` raises ``WorkerDiedError`` within about a
second, never a hang.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import time
from typing import Any

import zmq

from vtllm import envs
from vtllm.config import VtllmConfig
from vtllm.protocol import codec, transport
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)

WORKER_ENTRY = "vtllm.worker.worker:run_worker"
_POLL_MS = 200


class WorkerDiedError(RuntimeError):
    """A worker process exited or failed; the engine cannot go on."""


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

    # -- start-up --------------------------------------------------------------------

    def start(self) -> list[m.WorkerReport]:
        """Spawn the workers and wait until each has loaded the model and reported."""
        self._socket.bind(self.worker_address)
        ctx = multiprocessing.get_context("spawn")
        config_bytes = self.config.to_bytes()
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
        reports = self._gather(m.WorkerReport, envs.VT_WORKER_START_TIMEOUT_S, "load the model")
        return [reports[r] for r in range(self.world_size)]

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._broadcast(m.InitKVCache(num_blocks=num_blocks, block_size=block_size))
        self._gather(m.WorkerReady, envs.VT_WORKER_START_TIMEOUT_S, "allocate the KV cache")

    def _gather(self, kind: type, timeout_s: float, what: str) -> dict[int, Any]:
        """Wait for one ``kind`` message from every rank."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(got))
                raise WorkerDiedError(
                    f"workers {missing} did not {what} within {timeout_s:.0f}s "
                    "(raise VT_WORKER_START_TIMEOUT_S if the model is just slow to load)"
                )
            message = self._recv()
            if message is None:
                continue
            if not isinstance(message, kind):
                raise WorkerDiedError(f"expected {kind.__name__} from workers, got {message!r}")
            got[message.rank] = message
        return got

    # -- steps -----------------------------------------------------------------------

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        self._broadcast(step)
        while True:
            message = self._recv()
            if message is None:
                continue
            if isinstance(message, m.ModelRunnerOutput) and message.step_id == step.step_id:
                return message
            logger.warning("ignoring unexpected worker message %r", type(message).__name__)

    def _broadcast(self, message: Any) -> None:
        payload = codec.encode(message)
        for identity in self._identities:
            try:
                self._socket.send_multipart([identity, payload], copy=False)
            except zmq.ZMQError as e:
                raise WorkerDiedError(f"cannot reach worker {identity.decode()}: {e}") from None

    def _recv(self) -> Any:
        """One decoded worker message, or None after a poll interval with nothing.

        Raises ``WorkerDiedError`` if a worker failed or its process is gone.
        """
        if not self._socket.poll(_POLL_MS):
            self.check_alive()
            return None
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
            raise WorkerDiedError(f"worker rank {message.rank} failed: {message.message}")
        return message

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerDiedError(
                    f"worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                )

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
