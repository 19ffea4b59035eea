"""Faults injected into a real server: garbage on the engine socket, a ZMQ client that
vanishes mid-request. The engine logs and drops garbage, keeps serving a concurrent real
request, and frees a vanished client's blocks."""

from __future__ import annotations

import os
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from tests.e2e.server import ServerProcess, engine_address, engine_utility
from vtllm.protocol import codec
from vtllm.protocol import messages as m

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_dir, vt_cache_dir):
    with ServerProcess(
        "--kv-cache-memory",
        "128MiB",
        cache_dir=vt_cache_dir,
        env={"VT_HEARTBEAT_INTERVAL_S": "0.5", "VT_HEARTBEAT_TIMEOUT_S": "5"},
    ).serving() as srv:
        yield srv


GARBAGE = [
    b"",
    os.urandom(64),
    codec.encode(m.AddRequest("t", [1, 2, 3], m.SamplingParams()))[:-4],  # truncated
    msgspec.msgpack.encode(["add", 5, "not ids", None]),  # wrong types
    msgspec.msgpack.encode(["launch_missiles", 1, 2]),  # unknown kind
    msgspec.msgpack.encode({"a": 1}),  # not an array
    os.urandom(50 * 1024 * 1024),  # a huge frame
    codec.encode(m.Ready(1, "x", 1, 1, 1, 1, [])),  # a message of the other direction
]


def test_garbage_is_dropped_while_a_real_request_is_served(server):
    result: dict[str, httpx.Response] = {}

    def real_request() -> None:
        body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
        result["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=real_request)
    thread.start()
    ctx = zmq.Context()
    try:
        for hello_first in (False, True):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(engine_address(server))
            if hello_first:
                sock.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "garbage")))
            for frame in GARBAGE:
                sock.send(frame)
            sock.send_multipart([b"two", b"frames"])
            sock.close(linger=2000)
        old = ctx.socket(zmq.DEALER)
        old.connect(engine_address(server))
        old.send(codec.encode(m.Hello(m.PROTOCOL_VERSION + 7, "from-the-future")))
        assert old.poll(10_000)
        refused = codec.engine_to_client_decoder().decode(old.recv())
        assert isinstance(refused, m.HandshakeRefused) and "version" in refused.reason
        old.close(0)
    finally:
        ctx.term()
    thread.join(120)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"]
    assert "dropping an undecodable message" in server.log()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert engine_utility(server, "get_stats")["num_running"] == 0


def test_vanished_client_requests_are_aborted_and_freed(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, os.urandom(16))  # a session needs an unguessable id
    sock.connect(engine_address(server))
    sock.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "vanishing")))
    params = m.SamplingParams(max_tokens=2000, ignore_eos=True)
    sock.send(codec.encode(m.AddRequest("doomed", [1, 504, 3] * 20, params)))
    time.sleep(0.5)  # the request is in the engine (the log line below proves it)
    sock.close(0)  # no Goodbye, no more heartbeats: the client just disappears
    ctx.term()
    deadline = time.monotonic() + 15
    stats = engine_utility(server, "get_stats")
    while time.monotonic() < deadline and stats["num_running"]:
        time.sleep(0.3)
        stats = engine_utility(server, "get_stats")
    assert stats["num_running"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # the engine still owned the live request when the client went silent
    assert "client gone: aborting its 1 requests" in server.log()
