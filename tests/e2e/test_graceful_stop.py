"""`vtllm serve` stops gracefully: SIGTERM to the main process (``kill``) or to its whole
process group (systemd's control-group stop, Ctrl-C) lets streams that can finish within
--shutdown-timeout finish, ends the others with an error event and ``[DONE]`` (never a cut
connection), logs no traceback, and exits 0 after every child has exited."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.e2e.server import ServerProcess, cmdline, descendants, is_alive

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT_S = 10.0  # the short streams need one or two steps; a loaded CPU is slow


class Stream(threading.Thread):
    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.max_tokens = max_tokens
        self.events: list[str] = []
        self.started = threading.Event()
        self.cut: Exception | None = None

    def run(self) -> None:
        body = {
            "prompt": "Tell me a long story.",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        except httpx.HTTPError as e:
            self.cut = e


@pytest.mark.parametrize("target", ["main process", "process group"])
def test_sigterm_drains_streams_and_exits_0(smollm2_dir, vt_cache_dir, target: str):
    srv = ServerProcess(
        "--kv-cache-memory",
        "64MiB",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        env={"VT_TEST_WORKER_STEP_DELAY_S": "0.05"},  # ~20 steps/s: long streams outlast it
        cache_dir=vt_cache_dir,
    ).start()
    try:
        srv.wait_healthy()
        pids = descendants(srv.process.pid)
        short = [Stream(srv.url, 3) for _ in range(2)]
        long = [Stream(srv.url, 1000) for _ in range(2)]
        for stream in short + long:
            stream.start()
        for stream in short + long:
            assert stream.started.wait(60), srv.tail()
        if target == "main process":
            os.kill(srv.process.pid, signal.SIGTERM)
        else:
            os.killpg(srv.process.pid, signal.SIGTERM)
        for stream in short + long:
            stream.join(SHUTDOWN_TIMEOUT_S + 20)
            assert not stream.is_alive() and stream.cut is None, (stream.cut, srv.tail())
            assert stream.events[-1] == "[DONE]", (stream.events[-3:], srv.tail())
        for stream in short:
            last = json.loads(stream.events[-2])
            assert "choices" in last and last["choices"][0]["finish_reason"] == "length", (
                last,
                srv.tail(),
            )
        for stream in long:
            error = json.loads(stream.events[-2])["error"]
            assert "shutting down" in error["message"] or "shutdown" in error["message"], error
        assert srv.wait_exit(SHUTDOWN_TIMEOUT_S + 30) == 0, srv.tail()
        survivors = {p: cmdline(p) for p in pids if is_alive(p)}
        assert not survivors, f"children outlived the main process: {survivors}"
        assert "Traceback" not in srv.log(), srv.tail()
    finally:
        srv.stop()
