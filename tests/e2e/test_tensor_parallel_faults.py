"""A rank that dies or freezes under ``--tensor-parallel-size 2`` takes the engine down as
one worker does at TP=1 (test_engine_death.py, test_hung_worker.py): the open stream ends
with an error event naming the rank, /health answers 503 until the server exits non-zero,
and no process of the server is left behind. CPU (gloo), the tiny random Llama of
test_tensor_parallel.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import ServerProcess, cmdline, descendants, is_alive
from tests.e2e.test_hung_worker import _errors, _health_until_exit
from tests.e2e.test_tensor_parallel import save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, smollm2_dir):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny_tp_llama"), smollm2_dir)


def _stream(srv: ServerProcess, events: list[str], started: threading.Event) -> None:
    """Stream a completion as long as the model allows (max_model_len is 512)."""
    body = {"prompt": "Tell me a story.", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def _serve_tp2(model_dir, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        "--model",
        str(model_dir),
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        env=env,
    )


@pytest.mark.parametrize(
    ("sig", "expected"),
    [
        (signal.SIGKILL, "worker rank 1 (pid {pid}) exited with code -9"),
        (signal.SIGSTOP, "worker rank 1 (pid {pid}) sent no heartbeat"),
    ],
    ids=["sigkill", "sigstop"],
)
def test_rank1_death_or_freeze_during_a_stream(tiny_llama_dir, sig, expected):
    srv = _serve_tp2(tiny_llama_dir, env={"VT_WORKER_HEARTBEAT_TIMEOUT_S": "3"})
    with srv.serving():
        events: list[str] = []
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(srv, events, started))
        thread.start()
        assert started.wait(30), srv.tail()
        tree = descendants(srv.process.pid)
        victim = next(p for p in tree if "VTLLM::Worker_TP1" in cmdline(p))
        hit_at = time.monotonic()
        os.kill(victim, sig)
        thread.join(20)
        assert not thread.is_alive(), f"the stream did not end after rank 1 got {sig!r}"
        assert time.monotonic() - hit_at < 3 + 7
        errors = _errors(events)
        assert errors, events[-3:]
        assert expected.format(pid=victim) in errors[-1], (errors, srv.tail())
        health = _health_until_exit(srv, hit_at, 20)
        assert all(code == 503 for code in health), health
        assert srv.wait_exit(20) != 0
        if sig == signal.SIGSTOP:  # a frozen process cannot act on SIGTERM
            deadline = time.monotonic() + 10
            while is_alive(victim) and time.monotonic() < deadline:
                time.sleep(0.1)
        left = [f"{pid} {cmdline(pid)}" for pid in tree if is_alive(pid)]
        assert not left, (left, srv.tail())
