"""``--api-server-count N``: N HTTP frontend processes on one port, one engine core.

``vtllm serve`` itself is frontend 0; it spawns frontends 1..N-1 once the engine core
is started. Each binds nothing itself: the CLI bound N sockets to the port with
SO_REUSEPORT (``startup.bind_http_sockets``) and each process gets one, so the kernel
spreads connections over the processes. Each is a client of the engine core of its own
(the protocol allows many), with its own tokenizer, detokenizers and event loop::

    VTLLM::Frontend        frontend 0 (this process): HTTP, and the supervisor
    ├─ VTLLM::EngineCore
    ├─ VTLLM::APIServer_1  frontend 1: HTTP only
    └─ VTLLM::APIServer_N-1

``/metrics`` is the same whichever process answers (metrics_peers.py: each serves its
own registry on a unix socket in the runtime directory; the answering one sums).

Lifecycle: every frontend drains on SIGTERM/SIGINT by itself (systemd and Ctrl-C signal
the whole group). Frontend 0 stops the others after its own drain (SIGTERM, then waits
``--shutdown-timeout`` plus a margin) and before the engine core. A frontend that exits
while the server is serving stops the whole server with a non-zero exit code (systemd
restarts it); the others die with frontend 0 (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from vtllm.config import VtllmConfig
from vtllm.frontend.drain import PEER_STOP_SIGNAL
from vtllm.frontend.metrics_peers import MetricsPeers

logger = logging.getLogger("vtllm.api_servers")

_WATCH_S = 0.5


def metrics_paths(runtime_dir: Path, count: int) -> list[str]:
    return [str(runtime_dir / f"metrics-{i}.sock") for i in range(count)]


def peers_of(index: int, paths: list[str]) -> MetricsPeers:
    return MetricsPeers(paths[index], tuple(p for i, p in enumerate(paths) if i != index))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_api_server(
    config_bytes: bytes,
    model_dir: str,
    tokenizer_dir: str,
    engine_address: str,
    engine_pid: int | None,
    sock: socket.socket,
    index: int,
    peers: MetricsPeers,
) -> None:
    """Process entry of frontend ``index`` (1..N-1)."""
    from vtllm.frontend.app import run_frontend
    from vtllm.process import become_child_process

    become_child_process(f"VTLLM::APIServer_{index}")
    config = VtllmConfig.from_bytes(config_bytes)
    engine_alive = None if engine_pid is None else (lambda: pid_alive(engine_pid))
    code = run_frontend(
        config,
        model_dir,
        engine_address,
        engine_alive=engine_alive,
        sock=sock,
        tokenizer_dir=tokenizer_dir,
        metrics_peers=peers,
    )
    sys.exit(code)


class ApiServers:
    """Frontends 1..N-1 of this server, and the watch that stops the server when one of
    them exits on its own."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.failed: str | None = None  # why the server stopped itself, if it did
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def start(
        self,
        config: VtllmConfig,
        model_dir: str,
        tokenizer_dir: str,
        engine_address: str,
        engine_pid: int | None,
        sockets: list[socket.socket],
        paths: list[str],
    ) -> None:
        """Spawn one frontend per socket (frontend i + 1 gets ``sockets[i]``)."""
        ctx = multiprocessing.get_context("spawn")
        for i, sock in enumerate(sockets, start=1):
            process = ctx.Process(
                target=run_api_server,
                args=(
                    config.to_bytes(),
                    model_dir,
                    tokenizer_dir,
                    engine_address,
                    engine_pid,
                    sock,
                    i,
                    peers_of(i, paths),
                ),
                name=f"VTLLM::APIServer_{i}",
            )
            process.start()
            sock.close()  # the child holds its own copy
            self.processes.append(process)
        self._watch = threading.Thread(
            target=self._watch_loop, name="api-server-watch", daemon=True
        )
        self._watch.start()

    def _watch_loop(self) -> None:
        reported: set[int] = set()
        while not self._stopping.wait(_WATCH_S):
            for i, process in enumerate(self.processes, start=1):
                if process.is_alive() or i in reported or self._stopping.is_set():
                    continue
                reported.add(i)
                if process.exitcode == 0:  # stopped on request (a SIGTERM of its own)
                    logger.warning("API server %d stopped; the others serve on", i)
                    continue
                self.failed = f"API server {i} exited with code {process.exitcode}"
                logger.error("%s; stopping the server", self.failed)
                os.kill(os.getpid(), signal.SIGTERM)  # frontend 0 drains, then stops all
                return

    def stop(self, timeout_s: float) -> None:
        """Ask each to drain (``PEER_STOP_SIGNAL``: a no-op for one draining already), wait
        up to ``timeout_s`` for all of them, then SIGKILL what is left."""
        self._stopping.set()
        for process in self.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, PEER_STOP_SIGNAL)
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("%s did not stop within %.0fs; killing it", process.name, timeout_s)
                process.kill()
                process.join(5)
