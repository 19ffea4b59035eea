"""``vtllm serve --api-server-count 2``: two frontend processes on one port and one engine
core; connections reach both, ``/metrics`` sums over both whichever answers, a SIGTERM
stops everything with exit 0, and a frontend that dies stops the server non-zero."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import ServerProcess, cmdline, descendants, is_alive

pytestmark = pytest.mark.slow

NUM_REQUESTS = 16  # on fresh connections: all on one process by chance is 2 in 65536


def _server(vt_cache_dir) -> ServerProcess:
    return ServerProcess(
        "--kv-cache-memory", "64MiB", "--api-server-count", "2", cache_dir=vt_cache_dir
    )


def _api_server_pids(srv: ServerProcess) -> list[int]:
    return [p for p in descendants(srv.process.pid) if "VTLLM::APIServer_1" in cmdline(p)]


def _successes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vtllm:request_success_total"
    )


def test_two_frontends_share_the_port_and_the_metrics(smollm2_dir, vt_cache_dir) -> None:
    srv = _server(vt_cache_dir).start()
    try:
        srv.wait_healthy()
        assert len(_api_server_pids(srv)) == 1, srv.tail()
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        with ThreadPoolExecutor(8) as pool:  # httpx.post: a new connection each time
            answers = list(
                pool.map(
                    lambda _: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60),
                    range(NUM_REQUESTS),
                )
            )
        assert [r.status_code for r in answers] == [200] * NUM_REQUESTS, answers[0].text
        log = srv.log()
        served_by = {
            name: sum(1 for line in log.splitlines() if name in line and "POST /v1/" in line)
            for name in ("VTLLM::Frontend ", "VTLLM::APIServer_1 ")
        }
        assert all(served_by.values()) and sum(served_by.values()) == NUM_REQUESTS, served_by
        for _ in range(6):  # whichever process answers the scrape
            assert _successes(srv.url) == NUM_REQUESTS
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        pids = descendants(srv.process.pid)
        os.kill(srv.process.pid, signal.SIGTERM)  # the main process alone
        assert srv.wait_exit(60) == 0, srv.tail()
        survivors = {p: cmdline(p) for p in pids if is_alive(p)}
        assert not survivors, f"children outlived the main process: {survivors}\n{srv.tail()}"
        assert "Traceback" not in srv.log(), srv.tail()
    finally:
        srv.stop()


def test_a_frontend_that_dies_stops_the_server_non_zero(smollm2_dir, vt_cache_dir) -> None:
    srv = _server(vt_cache_dir).start()
    try:
        srv.wait_healthy()
        [api_server] = _api_server_pids(srv)
        pids = descendants(srv.process.pid)
        os.kill(api_server, signal.SIGKILL)
        assert srv.wait_exit(60) != 0, srv.tail()
        assert "API server 1 exited with code -9" in srv.log()
        survivors = {p: cmdline(p) for p in pids if is_alive(p)}
        assert not survivors, f"children outlived the main process: {survivors}\n{srv.tail()}"
    finally:
        srv.stop()
