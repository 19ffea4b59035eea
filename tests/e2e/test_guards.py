"""The never-wedge guards through real processes: start-up KV-fit refusal and auto-fit,
admission guards over HTTP and over raw ZMQ, and the heartbeat's stalled state.

SmolLM2 in fp32: 2 (K, V) × 30 layers × 3 KV heads × 64 dims × 4 bytes = 46080 bytes per
token, 737280 per 16-token block. 32 MiB = 45 blocks → 44 usable → max_model_len 704.
"""

from __future__ import annotations

import os
import re
import threading
import time

import httpx
import pytest
import zmq

from tests.e2e.server import ServerProcess, engine_address
from vtllm.protocol import codec
from vtllm.protocol import messages as m

pytestmark = pytest.mark.slow


def test_pinned_max_model_len_that_does_not_fit_refuses_to_start(smollm2_dir, vt_cache_dir):
    srv = ServerProcess(
        "--max-model-len", "8192", "--kv-cache-memory", "32MiB", cache_dir=vt_cache_dir
    ).start()
    try:
        code = srv.wait_exit(120)
        log = srv.log()
        assert code != 0, log
        assert (
            "--max-model-len 8192 needs 0.352 GiB of KV cache (513 blocks of 16 tokens, incl. "
            "1 reserved), but only 0.031 GiB (45 blocks) is available; the largest "
            "max_model_len that fits is 704. Lower --max-model-len to 704 or less"
        ) in log, log
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def small_kv_server(smollm2_dir, vt_cache_dir):
    with ServerProcess("--kv-cache-memory", "32MiB", cache_dir=vt_cache_dir).serving() as srv:
        yield srv


def test_unpinned_max_model_len_is_auto_fitted(small_kv_server):
    assert "max_model_len auto-fitted from 8192 to 704" in small_kv_server.log()
    models = httpx.get(f"{small_kv_server.url}/v1/models").json()
    assert models["data"][0]["max_model_len"] == 704


def test_http_400_names_prompt_tokens_and_max_model_len(small_kv_server):
    body = {"prompt": "hello " * 800, "max_tokens": 10}
    response = httpx.post(f"{small_kv_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert re.search(r"prompt has \d+ tokens.*max_model_len is 704", message), message


def test_direct_zmq_oversized_request_errors_while_others_are_served(small_kv_server):
    results: dict[str, object] = {}

    def normal_request() -> None:
        body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        results["http"] = httpx.post(
            f"{small_kv_server.url}/v1/completions", json=body, timeout=120
        )

    thread = threading.Thread(target=normal_request)
    thread.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, os.urandom(16))  # a session needs an unguessable id
    sock.connect(engine_address(small_kv_server))
    decoder = codec.engine_to_client_decoder()
    try:
        sock.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "raw-test")))
        assert sock.poll(10_000), "no Ready"
        ready = decoder.decode(sock.recv())
        assert isinstance(ready, m.Ready) and ready.max_model_len == 704
        huge = m.AddRequest("huge", [100] * 5000, m.SamplingParams(max_tokens=None))
        sock.send(codec.encode(huge))
        error = None
        deadline = time.monotonic() + 30
        while error is None and time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            message = decoder.decode(sock.recv())
            if isinstance(message, m.EngineOutputs):
                for out in message.outputs:
                    if out.request_id == "huge":
                        error = out
        assert error is not None, "no answer for the oversized request"
        assert error.finish_reason == m.FinishReason.ERROR
        assert "prompt has 5000 tokens, but max_model_len is 704" in error.error
    finally:
        sock.send(codec.encode(m.Goodbye()))
        sock.close(0)
        ctx.term()
    thread.join(120)
    assert results["http"].status_code == 200, results["http"].text
    assert results["http"].json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def slow_server(smollm2_dir, vt_cache_dir):
    """Every model execution takes 1.5 s: a stand-in for long prefills / a stuck device."""
    with ServerProcess(
        "--kv-cache-memory",
        "64MiB",
        cache_dir=vt_cache_dir,
        env={
            "VT_ENGINE_STEP_LOG": "0.3",
            "VT_TEST_WORKER_STEP_DELAY_S": "1.5",
            "VT_SSE_KEEPALIVE_S": "0.4",
        },
    ).serving() as srv:
        yield srv


def test_heartbeat_shows_idle_busy_and_stalled(slow_server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{slow_server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and slow_server.log().count("state=idle") < 2:
        time.sleep(0.2)
    log = slow_server.log()
    assert "state=idle running=0 waiting=0" in log
    assert re.search(r"state=stalled running=1 waiting=0 steps=0 model_executions=0", log)
    assert re.search(r"state=busy running=\d waiting=0 steps=1 model_executions=1", log)


def test_sse_keepalives_while_waiting_for_first_token(slow_server):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    keepalives = [line for line in lines[:first_data] if line == ": keepalive"]
    assert len(keepalives) >= 2, lines[:first_data]
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
