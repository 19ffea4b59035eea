"""A headless engine core stops gracefully: SIGTERM to its process group (as systemd's
control-group stop sends it) lets running requests finish, refuses new ones with a reason,
ends what is left at --shutdown-timeout with an error, tells its clients, exits 0."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import zmq

from tests.e2e.test_headless_engine import _start_engine, _wait_ready
from vtllm.protocol import codec
from vtllm.protocol import messages as m

pytestmark = pytest.mark.slow


def _run(address: str, shutdown_timeout: str, cache_dir: Path, max_tokens: int):
    """Start an engine, send one request, SIGTERM the group once it streams, then send a
    second request. Returns (outputs by request id, EngineDead seen, exit code, log)."""
    process, log = _start_engine(
        ["--engine-address", address, "--shutdown-timeout", shutdown_timeout], cache_dir
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, os.urandom(16))  # a session needs an unguessable id
    outputs: dict[str, list[m.RequestOutput]] = {"running": [], "late": []}
    dead = False
    try:
        _wait_ready(process, log)
        sock.connect(address)
        decoder = codec.engine_to_client_decoder()
        sock.send(codec.encode(m.Hello(m.PROTOCOL_VERSION, "drain-test")))
        params = m.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sock.send(codec.encode(m.AddRequest("running", [1, 504, 3], params)))
        signalled = False
        deadline = time.monotonic() + 60
        next_beat = 0.0
        while time.monotonic() < deadline and not dead:
            if time.monotonic() >= next_beat:
                # a live client's heartbeat: on a loaded machine the tokens may take
                # longer than VT_HEARTBEAT_TIMEOUT_S, and a silent client counts as gone
                sock.send(codec.encode(m.Heartbeat(timestamp=time.time())))
                next_beat = time.monotonic() + 1.0
            if not sock.poll(200):
                if process.poll() is not None:
                    break
                continue
            message = decoder.decode(sock.recv())
            if isinstance(message, m.EngineOutputs):
                for output in message.outputs:
                    outputs[output.request_id].append(output)
                if outputs["running"] and not signalled:
                    os.killpg(process.pid, signal.SIGTERM)
                    signalled = True
                    time.sleep(0.3)  # the signal is handled before the next add arrives
                    sock.send(codec.encode(m.AddRequest("late", [1, 504, 3], params)))
            elif isinstance(message, m.EngineDead):
                dead = True
        code = process.wait(30)
    finally:
        sock.close(0)
        ctx.term()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return outputs, dead, code, log.read_text()


def test_sigterm_lets_running_requests_finish_and_refuses_new_ones(
    smollm2_dir, vt_cache_dir, tmp_path
):
    # long enough to be running when the late request comes 0.3 s after the first output
    # (48 tokens took 0.3 s on two cores once the CPU decode got faster: a race)
    outputs, dead, code, log = _run(f"ipc://{tmp_path}/e.sock", "60", vt_cache_dir, 256)
    running = outputs["running"]
    assert running[-1].finish_reason == m.FinishReason.LENGTH, log
    assert sum(len(o.new_token_ids) for o in running) == 256
    late = outputs["late"]
    assert late and late[-1].finish_reason == m.FinishReason.ERROR
    assert "shutting down" in late[-1].error
    assert dead, "clients were not told that the engine core stopped"
    assert code == 0, log
    assert "stopping: refusing new requests" in log


def test_shutdown_timeout_ends_what_is_left_with_an_error(smollm2_dir, vt_cache_dir, tmp_path):
    outputs, dead, code, log = _run(f"ipc://{tmp_path}/e.sock", "0.5", vt_cache_dir, 2000)
    running = outputs["running"]
    assert running[-1].finish_reason == m.FinishReason.ERROR, log
    assert "shutdown timeout (0.5s, --shutdown-timeout)" in running[-1].error
    assert dead and code == 0, log
