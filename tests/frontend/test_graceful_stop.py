"""SIGTERM to a serving frontend (``run_frontend`` in a subprocess, FakeEngine here):
running streams finish within ``--shutdown-timeout``; past it they end with an error
event and ``[DONE]`` (non-streamed requests with a 503); new requests and ``/health`` get
503 meanwhile; the process exits 0 with no traceback in its log."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.frontend.test_run_frontend import start_frontend, wait_exit
from vtllm.frontend.tokenizer import ModelTokenizer

STORY = "Hello world! The quick brown fox jumps over the lazy dog. " * 4


class Stream(threading.Thread):
    """One streamed completion read to its end, in a thread; ``events`` are the ``data:``
    payloads, ``cut`` the transport error if the connection was cut."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events: list[str] = []
        self.started = threading.Event()
        self.cut: Exception | None = None

    def run(self) -> None:
        body = {"prompt": "Hi", "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        except httpx.HTTPError as e:
            self.cut = e

    def finish_reason(self) -> str | None:
        chunks = [json.loads(e) for e in self.events[:-1]]
        return chunks[-1]["choices"][0]["finish_reason"] if chunks else None


def _token_ids(model_dir: Path) -> list[int]:
    return ModelTokenizer.from_dir(model_dir).encode(STORY, add_special_tokens=False)


def _open_streams(url: str, count: int) -> list[Stream]:
    streams = [Stream(url) for _ in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(10), "stream did not start"
    return streams


def _log(proc) -> str:
    return proc.communicate(timeout=10)[0]


def test_sigterm_lets_running_streams_finish(tmp_path: Path, model_dir: Path) -> None:
    token_ids = _token_ids(model_dir)
    fake, proc, url = start_frontend(tmp_path, model_dir, token_ids, shutdown_timeout=20)
    try:
        fake.token_interval_s = 0.05  # each stream takes ~1.5 s
        streams = _open_streams(url, 3)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # the signal is handled asynchronously: wait until it took effect
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert health.status_code == 503 and "shutting down" in health.text, health.text
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        assert "shutting down" in refused.json()["error"]["message"]
        for stream in streams:
            stream.join(15)
            assert stream.cut is None and stream.events[-1] == "[DONE]", stream.events[-3:]
            assert stream.finish_reason() == "stop", stream.events[-3:]
            text = "".join(json.loads(e)["choices"][0]["text"] for e in stream.events[:-1])
            assert text == STORY
        assert wait_exit(proc, 10) == 0
        assert fake.goodbyes == 1
        log = _log(proc)
        assert "Traceback" not in log, log
        assert fake.aborted_snapshot() == []
    finally:
        proc.kill()
        fake.stop()


def test_past_the_shutdown_timeout_requests_end_with_an_error(
    tmp_path: Path, model_dir: Path
) -> None:
    token_ids = _token_ids(model_dir)
    fake, proc, url = start_frontend(tmp_path, model_dir, token_ids, shutdown_timeout=0.5)
    try:
        fake.token_interval_s = 0.5  # each stream would take ~15 s
        streams = _open_streams(url, 2)
        plain: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: plain.append(
                httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=30)
            ),
            daemon=True,
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while len(fake.added) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.join(10)
            assert stream.cut is None, stream.cut
            assert stream.events[-1] == "[DONE]", stream.events[-3:]
            error = json.loads(stream.events[-2])["error"]
            assert error["code"] == "shutting_down" and "--shutdown-timeout" in error["message"]
        waiting.join(10)
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "shutting_down"
        assert wait_exit(proc, 10) == 0
        assert time.monotonic() - signalled < 5
        log = _log(proc)
        assert "Traceback" not in log, log
        assert "ending 3 unfinished requests" in log, log
        assert sorted(fake.aborted_snapshot()) == sorted(r.request_id for r in fake.added)
    finally:
        proc.kill()
        fake.stop()
