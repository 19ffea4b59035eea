"""A real ``vtllm serve`` subprocess for end-to-end tests: free port, deadline on every
wait, stopped by its process group, its log printed when something fails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All live descendant pids of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child in children.get(parent, []):
            found.append(child)
            frontier.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, cache_dir: Path | None = None
    ):
        self.port = free_port()
        self.args = ["serve", "--port", str(self.port), *args]
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives with the server)
            prefix="vtllm-serve-", suffix=".log", delete=False
        )
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if cache_dir is not None:
            self.env["VT_CACHE_DIR"] = str(cache_dir)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vtllm.cli", *self.args],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        return self

    def wait_healthy(self, timeout_s: float = 180.0) -> float:
        """Seconds until /health answered 200. Fails (with the log) on exit or timeout."""
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not healthy after {timeout_s}s:\n{self.tail()}")

    @contextlib.contextmanager
    def serving(self, timeout_s: float = 180.0) -> Iterator[ServerProcess]:
        """Start, wait until healthy, and stop on the way out (fixtures yield inside)."""
        self.start()
        try:
            self.wait_healthy(timeout_s)
            yield self
        finally:
            self.stop()

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"server still running after {timeout_s}s:\n{self.tail()}"
            ) from None

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def tail(self) -> str:
        """The last 20000 characters of the log (for assertion messages)."""
        return self.log()[-20000:]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
        except ProcessLookupError:
            pass


def engine_address(server: ServerProcess) -> str:
    """The engine core's client socket, as its start-up log line names it."""
    import re

    match = re.search(r"engine core ready at (ipc://\S+)", server.log())
    assert match, server.tail()
    return match.group(1)


def engine_utility(server: ServerProcess, method: str, timeout_s: float = 10.0):
    """Call a utility method on the server's engine core over raw ZMQ (a second client)."""
    import zmq

    from vtllm.protocol import codec
    from vtllm.protocol import messages as m

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, os.urandom(16))  # a session needs an unguessable id
    sock.connect(engine_address(server))
    decoder = codec.engine_to_client_decoder()
    try:
        sock.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "test-utility")))
        sock.send(codec.encode(m.UtilityRequest(1, method)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            message = decoder.decode(sock.recv())
            if isinstance(message, m.UtilityResponse) and message.call_id == 1:
                assert message.ok, message.error
                return codec.decode_value(message.result)
        raise AssertionError(f"no answer to utility {method!r} within {timeout_s}s")
    finally:
        sock.send(codec.encode(m.Goodbye()))
        sock.close(0)
        ctx.term()
