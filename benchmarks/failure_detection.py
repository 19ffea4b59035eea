"""How long each kind of failure takes to reach a client, with the default settings.

Each scenario starts a real `vtllm serve` (the embedded model; the GPU when there is one),
opens a long stream, injects the failure once the stream is flowing, and reports the
seconds from the injection to the error event on the stream (or, for the stalled
frontend, whether the stream survived and how long a new request took afterwards)::

    hung-worker           SIGSTOP the worker     → "sent no heartbeat" (VT_WORKER_HEARTBEAT_TIMEOUT_S)
    killed-worker         SIGKILL the worker     → "exited with code -9"
    killed-engine         SIGKILL the engine core of `serve`  → the stream ends, serve exits 3
    killed-remote-engine  SIGKILL a `vtllm engine-core` behind `serve --engine-address`
    stalled-frontend      a frontend's event loop blocked 40 s mid-stream: the session survives
    frozen-frontend       SIGSTOP `serve` for 40 s: dropped, told so, re-handshakes, serves

Usage: ``python benchmarks/failure_detection.py [SCENARIO...]`` (all by default); one JSON
line per scenario on stdout. Nothing here overrides a VT_* timeout: it measures defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.server import ServerProcess, cmdline, descendants, free_port  # noqa: E402

STALL_S = 40.0
INSECURE_LOOPBACK = ("--engine-allow-insecure-loopback",)  # keys are not what this measures


class Stream(threading.Thread):
    """A long streamed completion; records when it started and when an error arrived."""

    def __init__(self, url: str, max_tokens: int = 2000) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.error_at: float | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self.num_events = 0
        self.done = False

    def run(self) -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": self.max_tokens, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.num_events += 1
                    self.started.set()
                    if line == "data: [DONE]":
                        self.done = True
                    elif '"error"' in line and self.error_at is None:
                        self.error_at = time.monotonic()
                        self.error = json.loads(line[6:])["error"]["message"]
        except httpx.HTTPError as e:
            self.error = self.error or f"connection: {e!r}"
        self.ended_at = time.monotonic()


def _process(server: ServerProcess, title: str) -> int:
    return next(p for p in descendants(server.process.pid) if title in cmdline(p))


def _inject_during_stream(server: ServerProcess, inject) -> dict:
    stream = Stream(server.url)
    stream.start()
    assert stream.started.wait(120), server.tail()
    time.sleep(1.0)
    injected_at = time.monotonic()
    inject()
    stream.join(90)
    end = stream.error_at or stream.ended_at
    return {
        "seconds_to_client": None if end is None else round(end - injected_at, 2),
        "error": (stream.error or "")[:160],
        "ended_with_done": stream.done,
    }


def _local(inject_title: str | None, sig: signal.Signals, cache_dir: Path) -> dict:
    with ServerProcess("--kv-cache-memory", "256MiB", cache_dir=cache_dir).serving() as srv:
        pid = srv.process.pid if inject_title is None else _process(srv, inject_title)
        result = _inject_during_stream(srv, lambda: os.kill(pid, sig))
        if inject_title == "EngineCore":
            started = time.monotonic()
            result["serve_exit_code"] = srv.wait_exit(60)
            result["serve_exit_s_after_stream_end"] = round(time.monotonic() - started, 2)
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
        return result


def _remote_engine(cache_dir: Path) -> dict:
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = _start_engine_core(address, cache_dir, *INSECURE_LOOPBACK)
    try:
        with ServerProcess("--engine-address", address, cache_dir=cache_dir).serving() as srv:
            result = _inject_during_stream(srv, lambda: os.kill(engine.pid, signal.SIGKILL))
            result["health_after"] = httpx.get(f"{srv.url}/health", timeout=5).status_code
            return result
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(20)


def _start_engine_core(address: str, cache_dir: Path, *args: str) -> subprocess.Popen:
    log = Path(tempfile.mkstemp(prefix="vtllm-engine-", suffix=".log")[1])
    engine = subprocess.Popen(
        [sys.executable, "-m", "vtllm.cli", "engine-core", "--kv-cache-memory", "256MiB"]
        + ["--engine-address", address, *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "VT_CACHE_DIR": str(cache_dir)},
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while "engine core ready at" not in log.read_text():
        assert engine.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return engine


def _stalled_frontend(cache_dir: Path) -> dict:
    """A frontend whose event loop is blocked for 40 s mid-stream (a huge body, a slow
    template): the protocol client of `serve`, in this process, against an engine core."""
    import asyncio

    from vtllm.protocol import messages as m
    from vtllm.protocol.async_client import EngineClient

    address = f"ipc://{tempfile.mkdtemp(prefix='vt-detect-')}/engine.sock"
    engine = _start_engine_core(address, cache_dir)

    async def run() -> dict:
        client = EngineClient()
        await client.connect(address, "stalled-frontend", timeout_s=30)
        try:
            params = m.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            num_tokens, error = 0, ""
            try:
                async for output in client.generate("long", [1, 2, 3, 4], params):
                    if num_tokens == 0:
                        time.sleep(STALL_S)  # the event loop is blocked, not the process
                    num_tokens += len(output.new_token_ids)
            except Exception as e:  # noqa: BLE001 (reported, not raised)
                error = f"{type(e).__name__}: {e}"
            resumed_at = time.monotonic()
            short = m.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            num_short = 0
            async for output in client.generate("after", [5, 6, 7], short):
                num_short += len(output.new_token_ids)
            return {
                "stalled_s": STALL_S,
                "stream_tokens": f"{num_tokens}/200",
                "error": error[:160],
                "new_request_tokens": num_short,
                "new_request_s": round(time.monotonic() - resumed_at, 2),
            }
        finally:
            await client.close()

    try:
        return asyncio.run(run())
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(30)


def _frozen_frontend(cache_dir: Path) -> dict:
    """SIGSTOP of the whole `serve` process (its session thread too) for 40 s: the engine
    core drops the silent client, and tells it so when it comes back."""
    with ServerProcess("--kv-cache-memory", "256MiB", cache_dir=cache_dir).serving() as srv:
        stream = Stream(srv.url, max_tokens=400)
        stream.start()
        assert stream.started.wait(120), srv.tail()
        os.kill(srv.process.pid, signal.SIGSTOP)
        time.sleep(STALL_S)
        os.kill(srv.process.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        stream.join(120)
        return {
            "frozen_s": STALL_S,
            "stream_error": (stream.error or "")[:160],
            "stream_ended_with_done": stream.done,
            "new_request_status": reply.status_code,
            "new_request_s_after_resume": round(time.monotonic() - resumed_at, 2),
        }


SCENARIOS = {
    "hung-worker": lambda d: _local("Worker_TP0", signal.SIGSTOP, d),
    "killed-worker": lambda d: _local("Worker_TP0", signal.SIGKILL, d),
    "killed-engine": lambda d: _local("EngineCore", signal.SIGKILL, d),
    "killed-remote-engine": _remote_engine,
    "stalled-frontend": _stalled_frontend,
    "frozen-frontend": _frozen_frontend,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], default=[])
    args = parser.parse_args()
    overridden = [k for k in os.environ if k.startswith("VT_") and k.endswith("_S")]
    if overridden:
        sys.exit(f"unset {overridden}: this measures the default timeouts")
    cache_dir = Path(os.environ.get("VT_CACHE_DIR", tempfile.mkdtemp(prefix="vt-detect-")))
    for name in args.scenarios or list(SCENARIOS):
        started = time.monotonic()
        result = SCENARIOS[name](cache_dir)
        print(json.dumps({"scenario": name, **result, "wall_s": round(time.monotonic() - started)}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
